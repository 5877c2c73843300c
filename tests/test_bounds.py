"""A bound on every member (max_member_bytes): bombs are refused before they take a worker's memory.

Each test writes a real shard holding one bomb among ordinary samples and reads it with a real loader and
a real worker process whose bound is 8 MiB. The bomb is skipped and counted (member_too_large), named in
one log line, every other sample arrives once, and the worker's peak resident memory (VmHWM: about 40 MiB
for a worker that decodes small samples) stays far below what the bomb expands to (512 MiB to 3.4 GiB):
without the bound each of these would pass it.
"""

import bz2
import functools
import io
import lzma
import struct
import zipfile
import zlib

import cbor2
import msgpack
import numpy as np
import pytest
import zstandard
from helpers import write_tar
from PIL import Image

from feedline import StagingLoader
from feedline.formats.decoders import DecodeError, Decoder, MemberTooLarge

MiB = 1 << 20
BOUND = 8 * MiB
MARGIN = 200 * MiB  # a worker's interpreter, numpy, Pillow and the mapped shard, with room to spare
BOMB = 1 << 30  # what the compressed bombs expand to
PIECE = 64 * MiB  # compressed once, repeated: a member of several streams, as `cat a.gz b.gz` makes
SAMPLES = 8
BAD = 5  # the bomb's sample: past the ones the trainer decodes to infer the spec (the first two)


@functools.lru_cache(maxsize=None)
def zeros_compressed(suffix: str, nbytes: int = BOMB) -> bytes:
    """``nbytes`` of zeros as a member of several compressed streams; built from one stream of 64 MiB."""
    compressor = {"gz": lambda: zlib.compressobj(9, zlib.DEFLATED, 31), "bz2": lambda: bz2.BZ2Compressor(9),
                  "xz": lambda: lzma.LZMACompressor(preset=0),
                  "zst": lambda: zstandard.ZstdCompressor(level=3).compressobj()}[suffix]()
    chunk = bytes(MiB)
    stream = b"".join(compressor.compress(chunk) for _ in range(PIECE // MiB)) + compressor.flush()
    return stream * (nbytes // PIECE)


def compress(suffix: str, data: bytes) -> bytes:
    return {"gz": lambda d: zlib.compress(d, wbits=31), "bz2": bz2.compress, "xz": lzma.compress,
            "zst": zstandard.ZstdCompressor().compress}[suffix](data)


def png(width: int, height: int, pixels: bytes | None = None) -> bytes:
    """A PNG of RGB pixels; without them, one whose header declares the size over a few bytes of data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    body = zlib.compress(pixels if pixels is not None else bytes(64))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


def small_png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((6, 8, 3), i, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def tenbin(arr: np.ndarray, shape: tuple[int, ...] | None = None) -> bytes:
    """webdataset's tenbin of ``arr``; with ``shape``, its header claims that shape instead."""
    from webdataset import tenbin as wds_tenbin

    raw = bytearray(wds_tenbin.encode_buffer([arr]))
    if shape is not None:
        words = np.frombuffer(raw, dtype="<i8")  # magic, length, then the header: dtype, info, rank, dims
        words[5 : 5 + len(shape)] = shape
    return bytes(raw)


def npz(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def npz_bomb(nbytes: int) -> bytes:
    """An .npz whose one array unzips to ``nbytes`` of zeros (written a MiB at a time)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open("a.npy", "w", force_zip64=True) as f:
            f.write(npy_header((nbytes,), "|u1"))
            chunk = bytes(MiB)
            for _ in range(nbytes // MiB):
                f.write(chunk)
    return buf.getvalue()


def shard(tmp_path, ext: str, good, bomb: bytes) -> str:
    """One shard of SAMPLES samples, each a .cls and an ``ext`` member: ``good(i)``, but the bomb at BAD."""
    samples = [(f"s{i:07d}", {"cls": str(i).encode(), ext: bomb if i == BAD else good(i)}) for i in range(SAMPLES)]
    return write_tar(str(tmp_path / "bombs.tar"), samples)


def peak_resident(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def read_past_the_bomb(path: str, ext: str, capfd, name: str) -> None:
    """The loader skips the bomb alone, counts it, logs it once, and its worker stays within the bound."""
    with StagingLoader([path], batch_size=4, workers=1, shuffle=False, max_member_bytes=BOUND,
                       max_sample_errors=1) as loader:
        got = sorted(int(i) for b in loader for i in b["cls"])
        stats = loader.stats()
        peaks = [peak_resident(pid) for pid in loader._pipeline.pool.worker_pids() if pid is not None]
    assert got == [i for i in range(SAMPLES) if i != BAD]
    assert stats.sample_errors_total["member_too_large"] == 1
    assert sum(stats.sample_errors_total.values()) == 1
    key = f"s{BAD:07d}"
    lines = [line for line in capfd.readouterr().err.splitlines() if repr(key) in line]
    assert len(lines) == 1, lines
    assert f"{path} sample {key!r}: member {ext!r}" in lines[0] and "max_member_bytes=8 MiB" in lines[0], lines[0]
    assert "FEEDLINE_MAX_MEMBER_BYTES" in lines[0] and "--max-member-bytes" in lines[0]
    assert peaks and max(peaks) < BOUND + MARGIN, [p >> 20 for p in peaks]
    print(f"worker peak with {name}: {max(peaks) / MiB:.0f} MiB")  # shown by pytest -rP


@pytest.mark.parametrize("suffix", ["gz", "bz2", "xz", "zst"])
def test_a_compressed_member_that_expands_past_the_bound_is_skipped_and_counted(tmp_path, capfd, suffix):
    ext = f"bin.{suffix}"
    path = shard(tmp_path, ext, lambda i: compress(suffix, bytes([i]) * 64), zeros_compressed(suffix))
    read_past_the_bomb(path, ext, capfd, f"1 GiB of {suffix}")


def test_an_image_whose_header_declares_more_pixels_than_the_bound_is_skipped_before_loading(tmp_path, capfd):
    path = shard(tmp_path, "png", small_png, png(30000, 30000))  # 3.4 GiB of pixels, in 160 bytes
    read_past_the_bomb(path, "png", capfd, "30000x30000 png")


def test_an_npy_header_declaring_more_than_the_bound_is_skipped(tmp_path, capfd):
    path = shard(tmp_path, "npy", lambda i: npy(np.arange(4, dtype=np.float32) + i),
                 npy_header((1 << 20, 1 << 20)) + bytes(64))
    read_past_the_bomb(path, "npy", capfd, "npy header")


def test_a_tenbin_header_declaring_more_than_the_bound_is_skipped(tmp_path, capfd):
    path = shard(tmp_path, "ten", lambda i: tenbin(np.full((2, 2), i, np.float32)),
                 tenbin(np.zeros((2, 2), np.float32), shape=(1 << 20, 1 << 20)))
    read_past_the_bomb(path, "ten", capfd, "tenbin header")


def test_an_npz_entry_that_unzips_past_the_bound_is_skipped(tmp_path, capfd):
    path = shard(tmp_path, "npz", lambda i: npz({"a": np.arange(4) + i}), npz_bomb(512 * MiB))
    read_past_the_bomb(path, "npz", capfd, "512 MiB npz entry")


def test_a_msgpack_member_declaring_a_string_longer_than_the_bound_is_skipped(tmp_path, capfd):
    path = shard(tmp_path, "mp", lambda i: msgpack.packb({"i": i}), b"\xc6" + struct.pack(">I", 1 << 31) + b"abc")
    read_past_the_bomb(path, "mp", capfd, "msgpack declared length")


def test_a_cbor_member_of_more_values_than_the_bound_holds_is_skipped(tmp_path, capfd):
    # 4 MiB of CBOR: 4096 arrays of 1000 empty arrays each, 4 million lists (about 300 MiB) once decoded
    inner = b"\x99" + struct.pack(">H", 1000) + b"\x80" * 1000
    bomb = b"\x99" + struct.pack(">H", 4096) + inner * 4096
    path = shard(tmp_path, "cbor", lambda i: cbor2.dumps({"i": i}), bomb)
    read_past_the_bomb(path, "cbor", capfd, "cbor of 4M lists")


def test_a_member_stored_larger_than_the_bound_is_skipped_undecoded(tmp_path, capfd):
    path = shard(tmp_path, "bin", lambda i: bytes([i]) * 64, bytes(BOUND + 1))
    read_past_the_bomb(path, "bin", capfd, "stored 8 MiB + 1")


@pytest.mark.parametrize("suffix", ["gz", "bz2", "xz", "zst"])
def test_a_member_that_expands_to_exactly_the_bound_decodes_and_one_byte_more_is_refused(suffix):
    decoder = Decoder(max_member_bytes=BOUND)
    assert len(decoder(f"bin.{suffix}", memoryview(compress(suffix, bytes(BOUND))))) == BOUND
    with pytest.raises(MemberTooLarge, match=rf"member 'bin.{suffix}' expands past max_member_bytes=8 MiB"):
        decoder(f"bin.{suffix}", memoryview(compress(suffix, bytes(BOUND + 1))))


def test_an_image_just_under_the_bound_decodes():
    side = int((BOUND // 4) ** 0.5)  # 1448 x 1448 RGB: 7.99 MiB at 4 bytes a pixel
    image = Decoder(max_member_bytes=BOUND)("png", memoryview(png(side, side, bytes(side * (1 + 3 * side)))))
    image.load()
    assert image.size == (side, side)
    with pytest.raises(MemberTooLarge, match=r"member 'png' declares .* pixels"):
        Decoder(max_member_bytes=BOUND)("png", memoryview(png(side + 1, side + 1)))


def test_nested_compression_is_bounded_at_every_layer():
    decoder = Decoder(max_member_bytes=BOUND)
    assert decoder("txt.gz.xz", memoryview(compress("xz", compress("gz", b"caption")))) == "caption"
    with pytest.raises(MemberTooLarge, match=r"member 'bin.gz.xz' expands"):
        decoder("bin.gz.xz", memoryview(compress("xz", zeros_compressed("gz", PIECE))))



def test_text_is_measured_as_the_string_it_becomes_not_as_its_bytes():
    decoder = Decoder(max_member_bytes=BOUND)
    ascii_text = b"a" * (BOUND - 1)  # one byte a character: fits
    assert len(decoder("txt", memoryview(ascii_text))) == BOUND - 1
    emoji = "\N{GRINNING FACE}".encode()  # past U+FFFF: every character of the str takes 4 bytes
    wide = b"a" * (BOUND // 2) + emoji  # 4 MiB of bytes, a 16 MiB str
    with pytest.raises(MemberTooLarge, match=r"member 'txt' decodes to a string of \d+ characters at 4 bytes"):
        decoder("txt", memoryview(wide))
    with pytest.raises(MemberTooLarge, match=r"member 'json' decodes to a string"):
        decoder("json", memoryview(b'"' + wide + b'"'))
    accented = "é".encode() * (BOUND // 4)  # 2 bytes of UTF-8, 1 of str each: a 2 MiB str
    assert len(decoder("txt", memoryview(accented))) == BOUND // 4


def test_json_of_more_values_than_the_bound_holds_is_refused_before_parsing():
    values = b"[" + b"0," * (BOUND // 64) + b"0]"  # 256 KiB of text, 131073 values at 64 bytes each: past 8 MiB
    with pytest.raises(MemberTooLarge, match=r"member 'json' decodes to more than \d+ values"):
        Decoder(max_member_bytes=BOUND)("json", memoryview(values))


def test_an_npy_header_longer_than_numpys_limit_is_corrupt_not_parsed():
    shape = "(" + "1," * 20_000 + ")"  # 40 KB of header: literal_eval of millions of these would take gigabytes
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}".encode()
    member = b"\x93NUMPY\x02\x00" + struct.pack("<I", len(header)) + header
    with pytest.raises(DecodeError, match=r"over numpy's limit of 10000") as raised:
        Decoder(max_member_bytes=BOUND)("npy", memoryview(member))
    assert not isinstance(raised.value, MemberTooLarge)


class PillowLimit:
    """Reports the decode worker's Pillow bomb limit and whether its warning is an error there."""

    def __call__(self, sample):
        import warnings

        from PIL import Image

        sample["limit"] = Image.MAX_IMAGE_PIXELS
        sample["error"] = int(any(f[0] == "error" and f[2] is Image.DecompressionBombWarning
                                  for f in warnings.filters))
        return sample


def test_pillows_bomb_limit_is_the_bound_in_the_workers_and_left_alone_in_the_training_process(tmp_path):
    from PIL import Image

    before = Image.MAX_IMAGE_PIXELS
    path = write_tar(str(tmp_path / "images.tar"), [(f"k{i}", {"png": small_png(i), "cls": b"1"}) for i in range(4)])
    with StagingLoader(path, batch_size=4, workers=1, max_member_bytes=BOUND, transform=PillowLimit(),
                       spec={"cls": "int64", "limit": "int64", "error": "int64"}) as loader:
        batch = next(iter(loader))
    assert batch["limit"].tolist() == [BOUND // 4] * 4 and batch["error"].tolist() == [1] * 4
    assert Image.MAX_IMAGE_PIXELS == before
