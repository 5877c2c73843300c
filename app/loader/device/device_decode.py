"""``device_decode=``: JPEG fields decoded where the batch lands, in batches; the workers copy compressed bytes.

Where the CPUs cannot decode as fast as the GPU trains (8-16 cores per GPU), the workers only place
each image's compressed bytes in a padded variable-length ring field (``<name>`` and
``<name>_len``), a fraction of the decoded size. The stage that hands batches over then decodes the
whole batch in one call — on a CUDA device with nvJPEG (``torchvision.io.decode_jpeg`` with
``device="cuda"``) or nvImageCodec, reading the pinned slot directly — and crops and resizes the
whole batch there in one go (``resize_crops``: torch's antialiased bilinear as two batched matrix
products, no operation launched per image), so the training loop receives ``(N, H, W, 3)`` uint8
images on the device as with CPU decoding. On a CPU host Pillow decodes in the loop's thread through
the same crop-and-resize code: no faster than the workers, but the same path, tested everywhere.

A member the batch decoder refuses (not a JPEG, a codec error) is decoded alone by Pillow; one
Pillow cannot read either is dropped from the batch — every field of that row — and counted as a
``corrupt`` sample. Each image's crop is drawn from ``(seed, epoch, key)`` — one CRC of the key, then
counter-based random numbers for the whole batch at once (``draw_boxes``) —: a sample gets the same
crop on every run, after a resume and after a worker is replaced, whichever batch it lands in.
"""

from __future__ import annotations

import importlib
import io
import logging
import threading
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...errors import SettingError
from ...formats.images import decode_image, image_formats
from ..layout.sample import FieldSelection
from ..layout.spec import Field, Spec, next_pow2
from .decode_settings import DeviceDecode

log = logging.getLogger("feedline.loader")


class AsCompressed:
    """The workers' decoder of a ``device_decode`` field: the member's bytes as a 1-D uint8 array, kept
    compressed — once its header says its pixels fit ``max_member_bytes`` (the trainer or the GPU decodes it,
    where ``worker_memory`` does not reach). Picklable, unlike a closure."""

    def __init__(self, bound: int):
        self.bound = bound

    def __call__(self, data: memoryview) -> np.ndarray:
        decode_image(data, self.bound)  # the header only: a lazy image, no pixel decoded
        return np.frombuffer(data, dtype=np.uint8)


def pick_backend(wanted: str, device: torch.device) -> list[str]:
    """The backends that may run, in the order to try them, or a ``SettingError`` saying what to install."""
    if device.type != "cuda":
        if wanted not in ("auto", "pillow"):
            raise SettingError("device_decode", f"backend={wanted!r} decodes on a CUDA device, but device="
                                                f"{str(device)!r}; use backend='auto' (Pillow on a CPU)")
        return ["pillow"]
    if wanted == "pillow":
        return ["pillow"]
    found = [name for name, ok in (("nvjpeg", _has_torchvision_decode()), ("nvimgcodec", _has_nvimgcodec())) if ok]
    if wanted != "auto":
        found = [name for name in found if name == wanted]
    if not found:
        raise SettingError(
            "device_decode", f"backend={wanted!r} on CUDA needs torchvision's decode_jpeg (a torchvision built for "
                             f"this torch) or nvImageCodec (pip install nvidia-nvimgcodec-cu12), and neither "
                             f"{'is' if wanted == 'auto' else 'of those asked for is'} importable here; install one, "
                             f"or pass backend='pillow' (decodes on the CPU, in the training process)")
    return found


def _has_torchvision_decode() -> bool:
    try:  # not installed, or built for another torch ('operator torchvision::nms does not exist')
        return hasattr(importlib.import_module("torchvision.io"), "decode_jpeg")
    except Exception:
        return False


def _has_nvimgcodec() -> bool:
    try:
        importlib.import_module("nvidia.nvimgcodec")
    except Exception:
        return False
    return True


def worker_decode(decode: bool | Mapping[str, Callable[[memoryview], Any]], spec: Spec | Mapping[str, Any] | None,
                  settings: DeviceDecode, selection: FieldSelection, bound: int
                  ) -> tuple[dict[str, Callable[[memoryview], Any]], Spec | None]:
    """(the workers' decoders, the declared spec): the device-decoded fields' members kept compressed
    (``AsCompressed``: their pixels checked against ``bound``), declared as such (``compressed_spec``)."""
    if decode is False:
        raise SettingError("device_decode", "decode=False keeps every member raw; use decode=True (or a dict of "
                                            "overrides) with device_decode")
    names = selection.names
    missing = [f for f in settings.fields if names is not None and f not in names]
    if missing:
        raise SettingError("device_decode", f"fields {missing} are not among fields= ({selection.describe()}); "
                                            f"name the batch fields to decode")
    exts = {e for f in settings.fields for e in (names[f] if names is not None else (f,))}
    return ({**(decode if isinstance(decode, Mapping) else {}), **{e: AsCompressed(bound) for e in exts}},
            compressed_spec(Spec.parse(spec), settings) if spec is not None else None)


def compressed_spec(spec: Spec, settings: DeviceDecode) -> Spec:
    """``spec`` with each device-decoded field a padded variable-length uint8 field (compressed bytes)."""
    fields = []
    for f in spec.fields:
        if f.name in settings.fields and not (f.variable and f.dtype == "|u1" and len(f.shape) == 1):
            if f.side or f.dtype != "|u1" or len(f.shape) != 1:
                raise SettingError("device_decode", f"field {f.name!r} holds {f.dtype} {f.shape} in the spec; a "
                                                    f"device-decoded field holds compressed bytes: declare it "
                                                    f"{{'dtype': 'uint8', 'shape': [capacity], 'variable': True}} "
                                                    f"or leave it to be inferred")
            f = Field(f.name, "uint8", (next_pow2(max(64, int(f.shape[0] * 1.25))),), f.source, variable=True)
        fields.append(f)
    absent = set(settings.fields) - {f.name for f in fields}
    if absent:
        raise SettingError("device_decode", f"fields {sorted(absent)} are not in the batch spec "
                                            f"({', '.join(f.name for f in fields)})")
    return Spec(tuple(fields))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _uniform(seeds: np.ndarray, n: int) -> np.ndarray:
    """(len(seeds), n) uniform floats in [0, 1): SplitMix64 of each seed's counter, the whole batch at once."""
    with np.errstate(over="ignore"):
        z = seeds[:, None] + np.arange(1, n + 1, dtype=np.uint64)[None, :] * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def key_seeds(seed: int, epoch: int, name: str, keys: Sequence[str]) -> np.ndarray:
    """A 64-bit seed an image from (seed, epoch, field, key): a CRC of the key on a base made once a batch."""
    base = zlib.crc32(f"feedline-device-decode:{seed}:{epoch}:{name}".encode())
    return np.fromiter(((base << 32) | zlib.crc32(k.encode(), base) for k in keys), dtype=np.uint64, count=len(keys))


_TRIES = 10  # Inception's random crop: ten draws of area and aspect, then the centred square


def draw_boxes(heights: np.ndarray, widths: np.ndarray, settings: DeviceDecode, seeds: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(boxes (N, 4) int64 as top, left, bottom, right; flips (N,) bool) for the whole batch, vectorized."""
    h, w = heights.astype(np.float64), widths.astype(np.float64)
    flips = np.zeros(len(h), dtype=bool)
    if settings.crop == "random":
        u = _uniform(seeds, 4 * _TRIES + 1)
        lo, hi = settings.scale
        lr0, lr1 = np.log(settings.ratio[0]), np.log(settings.ratio[1])
        target = (h * w)[:, None] * (lo + (hi - lo) * u[:, :_TRIES])
        aspect = np.exp(lr0 + (lr1 - lr0) * u[:, _TRIES : 2 * _TRIES])
        cw, ch = np.sqrt(target * aspect), np.sqrt(target / aspect)
        fits = (cw > 0) & (cw <= w[:, None]) & (ch > 0) & (ch <= h[:, None])
        first = np.argmax(fits, axis=1)
        rows = np.arange(len(h))
        found = fits[rows, first]
        cw, ch = cw[rows, first], ch[rows, first]
        x0 = u[rows, 2 * _TRIES + first] * (w - cw)
        y0 = u[rows, 3 * _TRIES + first] * (h - ch)
        side = np.minimum(w, h)  # the fallback: the centred square
        x0 = np.where(found, x0, (w - side) / 2)
        y0 = np.where(found, y0, (h - side) / 2)
        cw, ch = np.where(found, cw, side), np.where(found, ch, side)
        if settings.flip:
            flips = u[:, 4 * _TRIES] < 0.5
    else:
        oh, ow = settings.size  # type: ignore[misc]
        wide = w * oh > h * ow  # wider than the output: full height
        cw, ch = np.where(wide, h * ow / oh, w), np.where(wide, h, w * oh / ow)
        x0, y0 = (w - cw) / 2, (h - ch) / 2
    top, left = np.floor(y0).astype(np.int64), np.floor(x0).astype(np.int64)
    bottom = np.maximum(top + 1, np.minimum(heights, np.rint(y0 + ch).astype(np.int64)))
    right = np.maximum(left + 1, np.minimum(widths, np.rint(x0 + cw).astype(np.int64)))
    return np.stack([top, left, bottom, right], axis=1), flips


def crop_box(height: int, width: int, settings: DeviceDecode, seed: int = 0) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of the region one image is resized from (``draw_boxes`` for one)."""
    boxes, _ = draw_boxes(np.array([height]), np.array([width]), settings, np.array([seed], dtype=np.uint64))
    return tuple(int(v) for v in boxes[0])  # type: ignore[return-value]


def _weights(start: torch.Tensor, stop: torch.Tensor, out: int, size: int) -> torch.Tensor:
    """(N, out, size) rows of torch's antialiased bilinear filter, resampling [start, stop) of each row's
    axis to ``out`` samples (zero outside the span), normalized: one matrix product resizes a batch."""
    scale = (stop - start).to(torch.float32) / out  # (N,)
    support = scale.clamp(min=1.0)
    centre = start[:, None].to(torch.float32) + scale[:, None] * (torch.arange(out, device=scale.device) + 0.5)
    src = torch.arange(size, device=scale.device, dtype=torch.float32) + 0.5
    w = (1 - (src[None, None, :] - centre[:, :, None]).abs() / support[:, None, None]).clamp_(min=0)
    inside = (src[None, :] >= start[:, None]) & (src[None, :] < stop[:, None])  # (N, size)
    w = w * inside[:, None, :]
    return w / w.sum(-1, keepdim=True).clamp_(min=1e-12)


def resize_crops(images: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int], flips: torch.Tensor
                 ) -> torch.Tensor:
    """A batch of (N, C, H, W) uint8 images (padded), each cropped to its box (top, left, bottom, right) and
    resized to ``size`` with torch's antialiased bilinear filter, flipped where asked: (N, h, w, C) uint8.

    Separable, as the filter is: the rows then the columns as two batched matrix products on the images'
    device — a handful of launches for the whole batch, whatever its size.
    """
    n, _, height, width = images.shape
    oh, ow = size
    rows = _weights(boxes[:, 0], boxes[:, 2], oh, height)  # (N, oh, H)
    cols = _weights(boxes[:, 1], boxes[:, 3], ow, width)  # (N, ow, W)
    cols = torch.where(flips[:, None, None], cols.flip(1), cols)
    x = images.to(torch.float32)
    x = torch.matmul(x, cols.transpose(1, 2)[:, None])  # (N, C, H, ow)
    x = torch.matmul(rows[:, None], x)  # (N, C, oh, ow)
    return x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def _padded(images: list[torch.Tensor]) -> torch.Tensor:
    """(N, C, Hmax, Wmax) from CHW images of several sizes: one nested tensor, padded in one call."""
    if len({tuple(i.shape) for i in images}) == 1:
        return torch.stack(images)
    with warnings.catch_warnings():  # "prototype stage": the padded copy is all that is used of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(images).to_padded_tensor(0)


def _pillow_chw(data: np.ndarray) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(data.tobytes()), formats=image_formats()) as img:
        rgb = np.array(img.convert("RGB"))  # writable: torch takes it as it is
    return torch.from_numpy(rgb).permute(2, 0, 1)


class DeviceDecoder:
    """Decodes a batch's compressed image fields on ``device`` and fits the batch's other fields to what survived."""

    def __init__(self, settings: DeviceDecode, device: torch.device, seed: int,
                 on_corrupt: Callable[[int], None] = lambda n: None):
        self.settings = settings
        self.device = device
        self.seed = seed
        self.epoch = 0  # the loader's, set as each epoch starts: a seed of the crops
        self._on_corrupt = on_corrupt
        self._local = threading.local()  # an nvImageCodec decoder per transfer thread
        self._warned = False
        if device.type == "cuda" and device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        tried = []
        for backend in pick_backend(settings.backend, self.device):  # each tried on a small JPEG, once
            self.backend = backend
            why = self._works()
            if why is None:
                break
            tried.append(f"{backend}: {why}")
        else:
            raise SettingError("device_decode", f"no backend decoded a test JPEG on {self.device} "
                                                f"({'; '.join(tried)}); pass backend='pillow' to decode on the CPU")
        log.info("device_decode: %s decoded on %s by %s, %dx%d, %s crop", ", ".join(settings.fields), device,
                 self.backend, settings.size[0], settings.size[1], settings.crop)  # type: ignore[index]

    def _works(self) -> str | None:
        """None if this backend decodes a small JPEG on the device, else why not."""
        if self.backend == "pillow":
            return None
        buf = io.BytesIO()
        from PIL import Image

        Image.new("RGB", (16, 8), (200, 30, 30)).save(buf, format="JPEG")
        try:
            img = self._batch([torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)])[0]
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        if img is None or tuple(img.shape) != (3, 8, 16) or img.device != self.device:
            return f"it returned {None if img is None else (tuple(img.shape), str(img.device))}"
        return None

    def apply(self, tensors: dict[str, torch.Tensor], extra: dict[str, list[Any]],
              host: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
        """``tensors`` with each image field decoded (``<name>_len`` gone); rows nothing could decode dropped.

        ``host``: the slot's fields in the (pinned) ring where ``tensors`` are already device copies — the
        compressed bytes are read there. Each row's crop is drawn from the seed, the epoch and its key.
        """
        source = host if host is not None else tensors
        keys = extra["__key__"]  # every batch carries its keys (side.py)
        out = {k: v for k, v in tensors.items()}
        bad = np.zeros(len(keys), dtype=bool)
        decoded: dict[str, list[torch.Tensor | None]] = {}
        for name in self.settings.fields:
            out.pop(name), out.pop(f"{name}_len")
            data, lengths = source[name], source[f"{name}_len"]
            lens = lengths.tolist()  # host memory: no device sync
            members = [data[i, :n] for i, n in enumerate(lens)]
            head = data[:, :2].numpy() if data.shape[1] >= 2 else np.zeros((len(lens), 2), np.uint8)
            jpeg = (np.asarray(lens) > 2) & (head[:, 0] == 0xFF) & (head[:, 1] == 0xD8)
            images = self._decode(members, jpeg)
            bad |= np.fromiter((img is None for img in images), dtype=bool, count=len(images))
            decoded[name] = images
        keep = np.flatnonzero(~bad)
        h, w = self.settings.size  # type: ignore[misc]
        for name, images in decoded.items():
            kept = [images[i] for i in keep]
            if not kept:
                out[name] = torch.empty((0, h, w, 3), dtype=torch.uint8, device=self.device)
                continue
            sizes = np.array([img.shape[1:] for img in kept], dtype=np.int64)  # type: ignore[union-attr]
            boxes, flips = draw_boxes(sizes[:, 0], sizes[:, 1], self.settings,
                                      key_seeds(self.seed, self.epoch, name, [keys[i] for i in keep]))
            padded = _padded(kept).to(self.device, non_blocking=True)  # type: ignore[arg-type]  (Pillow's: one copy)
            out[name] = resize_crops(padded, torch.from_numpy(boxes).to(self.device, non_blocking=True),
                                     (h, w), torch.from_numpy(flips).to(self.device, non_blocking=True))
        if bad.any():
            self._on_corrupt(int(bad.sum()))
            rows = torch.from_numpy(keep)
            out = {k: v if k in decoded else v.index_select(0, rows.to(v.device)) for k, v in out.items()}
            extra = {k: [v[i] for i in keep] for k, v in extra.items()}
        return out, extra

    def _decode(self, members: Sequence[torch.Tensor], is_jpeg: np.ndarray) -> list[torch.Tensor | None]:
        """CHW uint8 images on the device, None where nothing could decode the member."""
        if self.backend == "pillow":
            return [self._one_pillow(m) for m in members]
        jpeg = np.flatnonzero(is_jpeg).tolist()
        out: list[torch.Tensor | None] = [None] * len(members)
        try:
            for i, img in zip(jpeg, self._batch([members[i] for i in jpeg])):
                out[i] = img
        except RuntimeError as exc:  # one bad member fails the batch call: decode them one by one
            if not self._warned:
                self._warned = True
                log.warning("device_decode: a batch call of %s failed (%s); its members are decoded one by one, "
                            "those it refuses by Pillow on the CPU (logged once)", self.backend, exc)
            for i in jpeg:
                try:
                    out[i] = self._batch([members[i]])[0]
                except RuntimeError:
                    out[i] = None
        for i, img in enumerate(out):
            if img is None:  # not a JPEG, or refused: Pillow on the CPU, then to the device
                cpu = self._one_pillow(members[i])
                out[i] = cpu.to(self.device) if cpu is not None else None
        return out

    def _batch(self, members: list[torch.Tensor]) -> list[torch.Tensor | None]:
        if not members:
            return []
        if self.backend == "nvjpeg":
            from torchvision.io import ImageReadMode, decode_jpeg

            return list(decode_jpeg(members, mode=ImageReadMode.RGB, device=self.device))
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            from nvidia import nvimgcodec

            decoder = self._local.decoder = nvimgcodec.Decoder(device_id=self.device.index)
        # on this thread's stream, so the crops after it (and the slot's release) wait for it
        images = decoder.decode([m.numpy() for m in members],
                                cuda_stream=torch.cuda.current_stream(self.device).cuda_stream)
        return [torch.as_tensor(img, device=self.device).permute(2, 0, 1) if img is not None else None
                for img in images]

    @staticmethod
    def _one_pillow(member: torch.Tensor) -> torch.Tensor | None:
        try:
            return _pillow_chw(member.numpy())
        except Exception as exc:  # Pillow raises many kinds for bad data
            log.debug("cannot decode a member: %s", exc)
            return None
