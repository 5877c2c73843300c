"""Write WebDataset-convention tar shards of a target size (``feedline make-shards``)."""

from __future__ import annotations

import io
import os
import random
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from .shard_index import build_index, split_key, write_index

TAR_BLOCK = 512
T = TypeVar("T")


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


def _ordered(items: list[T], shuffle_seed: int | None) -> list[T]:
    """``items`` in a seeded random order, or as they are (``shuffle_seed`` None).

    A dataset packed in its folders' order (a folder per class) would reach training in that order, a shard
    or two of one class at a time; shuffled once when written, every shard holds a mix.
    """
    if shuffle_seed is not None:
        random.Random(f"feedline-make-shards:{shuffle_seed}").shuffle(items)
    return items


def samples_from_folder(folder: str, shuffle_seed: int | None = None) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Files sharing a basename (``a.jpg``, ``a.cls``) form one sample: in sorted order, or shuffled by
    ``shuffle_seed`` (only the paths are held; each sample's bytes are read as it is written)."""
    groups: dict[str, dict[str, str]] = {}
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        parts = split_key(str(path.relative_to(root)))
        if parts is None:
            continue
        groups.setdefault(parts[0], {})[parts[1]] = str(path)
    for key, files in _ordered(list(groups.items()), shuffle_seed):
        yield key.replace(os.sep, "/"), {ext: Path(p).read_bytes() for ext, p in files.items()}


def class_folders(folder: str) -> list[str]:
    """The first-level folders of ``folder``, sorted: class ``i`` is the ``i``-th (ImageFolder's and Kinetics'
    layout, ``<folder>/<class>/<file>``)."""
    return sorted(p.name for p in Path(folder).iterdir() if p.is_dir())


def samples_from_class_folders(folder: str, shuffle_seed: int | None = None
                               ) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``<folder>/<class>/...``: files sharing a basename form a sample, labelled with its class's index in
    ``class_folders`` (as ``cls``); files outside a class folder are left out."""
    classes = {name: i for i, name in enumerate(class_folders(folder))}
    for key, fields in samples_from_folder(folder, shuffle_seed):
        top = key.split("/", 1)[0]
        if "/" in key and top in classes:
            yield key, {**fields, "cls": str(classes[top]).encode()}


def samples_from_list(list_file: str, shuffle_seed: int | None = None) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Lines of ``path label``; relative paths are taken from the list file's folder. A sample's key is its line
    number, whatever the order (``shuffle_seed``); every path is checked before anything is written."""
    base = Path(list_file).parent
    entries: list[tuple[str, Path, str]] = []
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
            entries.append((f"{lineno - 1:09d}", path, label.strip()))
    for key, path, label in _ordered(entries, shuffle_seed):
        ext = path.suffix.lstrip(".").lower() or "bin"
        fields = {ext: path.read_bytes()}
        if label:
            fields["cls"] = label.encode()
        yield key, fields


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
