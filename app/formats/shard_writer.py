"""Write WebDataset-convention tar shards of a target size (``feedline make-shards``)."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .shard_index import build_index, split_key, write_index

TAR_BLOCK = 512


@dataclass
class ShardWriter:
    """Packs samples (key -> {ext: bytes}) into ``<outdir>/<prefix>-NNNNNN.tar`` files.

    A shard is written under a temporary name and renamed when complete, so a
    crash never leaves a half-written shard under a published name.
    """

    outdir: str
    prefix: str = "shard"
    target_bytes: int = 256 << 20
    write_index: bool = True
    shards: list[str] = field(default_factory=list)
    _tar: tarfile.TarFile | None = None
    _tmp: str = ""
    _bytes: int = 0

    def __post_init__(self) -> None:
        if self.target_bytes < TAR_BLOCK:
            raise ValueError(f"target shard size must be at least {TAR_BLOCK} bytes, got {self.target_bytes}")
        os.makedirs(self.outdir, exist_ok=True)

    def _open(self) -> None:
        name = os.path.join(self.outdir, f"{self.prefix}-{len(self.shards):06d}.tar")
        self._tmp = name + ".partial"
        self._tar = tarfile.open(self._tmp, mode="w", format=tarfile.GNU_FORMAT)
        self.shards.append(name)
        self._bytes = 0

    def write(self, key: str, fields: Mapping[str, bytes]) -> None:
        if "." in os.path.basename(key):
            raise ValueError(f"sample key {key!r} must not contain a dot in its last component")
        if self._tar is None or self._bytes >= self.target_bytes:
            self._finish()
            self._open()
        assert self._tar is not None
        for ext, data in fields.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mode = 0o644
            self._tar.addfile(info, io.BytesIO(data))
            self._bytes += TAR_BLOCK + (len(data) + TAR_BLOCK - 1) // TAR_BLOCK * TAR_BLOCK

    def _finish(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        with open(self._tmp, "rb+") as f:
            os.fsync(f.fileno())
        final = self.shards[-1]
        os.replace(self._tmp, final)
        if self.write_index:
            write_index(build_index(final))
        self._tar = None

    def close(self) -> list[str]:
        self._finish()
        return list(self.shards)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self._tar is not None:
            self._tar.close()
            os.unlink(self._tmp)
            self.shards.pop()
            self._tar = None
            return
        self.close()


def samples_from_folder(folder: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Files sharing a basename (``a.jpg``, ``a.cls``) form one sample, in sorted order."""
    groups: dict[str, dict[str, str]] = {}
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        parts = split_key(str(path.relative_to(root)))
        if parts is None:
            continue
        groups.setdefault(parts[0], {})[parts[1]] = str(path)
    for key, files in groups.items():
        yield key.replace(os.sep, "/"), {ext: Path(p).read_bytes() for ext, p in files.items()}


def samples_from_list(list_file: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Lines of ``path label``; relative paths are taken from the list file's folder."""
    base = Path(list_file).parent
    with open(list_file) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            path_s, _, label = line.rpartition(" ")
            if not path_s:
                path_s, label = label, ""
            path = Path(path_s.strip())
            if not path.is_absolute():
                path = base / path
            if not path.is_file():
                raise FileNotFoundError(f"{list_file}:{lineno}: no such file {path}")
            ext = path.suffix.lstrip(".").lower() or "bin"
            fields = {ext: path.read_bytes()}
            if label:
                fields["cls"] = label.strip().encode()
            yield f"{lineno - 1:09d}", fields


def write_shards(
    samples: Iterable[tuple[str, Mapping[str, bytes]]],
    outdir: str,
    prefix: str = "shard",
    target_bytes: int = 256 << 20,
) -> list[str]:
    with ShardWriter(outdir, prefix, target_bytes) as writer:
        for key, fields in samples:
            writer.write(key, fields)
    return writer.shards
