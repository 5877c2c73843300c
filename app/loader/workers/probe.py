"""Learn or check the batch layout from the data itself, in the trainer process, before any worker starts.

A few samples spread over the first shards are decoded and transformed as a
worker would; while none of them reads, the next ones are tried, as many as the
epoch's failure budget would let go unread (at most ``PROBE_MOST``). What it
passes over is not logged here: the workers log each sample they skip, once,
and a refusal says what it tried, once. A declared spec is checked against each (a mismatch is refused at
construction with the field named); an absent one is inferred from all of them,
so a caption longer than the first one, or images of several sizes, are known
before the epoch starts, not after. The shard indexes add the longest member of
each extension, which sizes padded fields with headroom.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import mmap
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import SettingError
from ...formats import parquet, tfrecord
from ...formats.bounds import DecodeError, MemberTooLarge
from ...formats.decoders import Decoder, UnsafeMemberError
from ...formats.shard_index import ShardError, SharedIndexes, load_index
from ..layout.sample import FieldSelection, Transform, load_sample
from ..layout.side import DEFAULT_SIDE_BYTES, KEY_ONLY_SIDE_BYTES, encode
from ..layout.spec import SampleRejected, Spec, fill

if TYPE_CHECKING:
    from .worker import WorkerCode

log = logging.getLogger("feedline.loader")

PROBE_SHARDS = 8  # shards the samples are drawn from
PROBE_PER_SHARD = 2  # samples read from the start of each
PROBE_MOST = 64  # samples tried in all, however large the failure budget, while none reads


@dataclass
class Probe:
    """What the first samples of the data look like."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    largest: dict[str, int] = field(default_factory=dict)  # longest member per extension, from the indexes
    refused: list[tuple[str, str, Exception]] = field(default_factory=list)  # (shard, key, why) of samples not read
    bad_shards: list[str] = field(default_factory=list)  # why each shard that could not be indexed was not
    indexed: int = 0  # samples the probed shards' indexes hold
    shards: int = 0  # shards probed

    def tried(self) -> str:
        """What was tried, for a refusal: samples, and shards."""
        samples = len(self.refused) + len(self.samples)
        return (f"{samples} sample{'s' if samples != 1 else ''} tried in {self.shards} "
                f"shard{'s' if self.shards != 1 else ''}")


def allowed_refusals(max_errors: float, indexed: int) -> int:
    """Samples the probe may find unreadable before it refuses: the epoch's failure budget (``max_sample_errors``: a
    count, or a fraction of the samples indexed), plus one, within ``PROBE_MOST``."""
    budget = int(max_errors) if max_errors >= 1 else math.ceil(max_errors * indexed)
    return min(PROBE_MOST, budget + 1)


def probe(shards: list[str], decoder: Decoder, selection: FieldSelection, wanted: set[str] | None,
          transform: Transform | None, max_errors: float = 0.0, share: SharedIndexes | None = None) -> Probe:
    """Decode (and transform) the first samples of the first shards, as a worker would; while none of them reads,
    the next ones in turn, as long as the failure budget (``max_errors``) would let the epoch go on."""
    found = Probe()
    for kind, test, packages in (("a TFRecord", tfrecord.is_tfrecord, tfrecord.PACKAGES),
                                 ("a Parquet", parquet.is_parquet, parquet.PACKAGES)):
        first = next((p for p in shards if test(p)), None)
        missing = [package for module, package in packages.items() if not _installed(module)] if first else []
        if missing:
            raise SettingError("shards", f"{first} is {kind} file, and reading one needs {' and '.join(missing)}, "
                                         f"which is not installed: pip install {' '.join(missing)} (feedline depends "
                                         f"on it; an install with --no-deps leaves it out)")
    opened: list[tuple[str, memoryview, list[Any]]] = []  # (path, its mapping, its samples' index entries)
    try:
        for path in sorted(shards)[:PROBE_SHARDS]:
            found.shards += 1
            try:
                index = load_index(path, share=share)  # left there: the workers copy it
            except ShardError as exc:
                found.bad_shards.append(str(exc))
                continue
            found.indexed += len(index.samples)
            records = tfrecord.is_tfrecord(path) or parquet.is_parquet(path)
            for ref in index.samples if not records else ():  # a record's index entry is a place, not a member
                for ext, (_, size) in ref.fields.items():
                    found.largest[ext] = max(found.largest.get(ext, 0), size)
            _check_packages(decoder, _decoded(found.largest, selection, wanted), path)
            if not index.samples:
                continue
            # mapped, not read, as a worker maps it: a member past max_member_bytes (a hole in a compressed shard's
            # plain copy) is refused unread, never copied into the training process; a Parquet row is read from it
            with open(path, "rb") as f:
                data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            opened.append((path, data, index.samples))
            for ref in index.samples[:PROBE_PER_SHARD]:
                _read(found, data, path, ref, decoder, selection, wanted, transform)
        allowed = allowed_refusals(max_errors, found.indexed)
        depth = PROBE_PER_SHARD
        while not found.samples and len(found.refused) < allowed and any(depth < len(refs) for *_, refs in opened):
            for path, data, refs in opened:  # the next sample of each shard in turn
                if depth < len(refs) and not found.samples and len(found.refused) < allowed:
                    _read(found, data, path, refs[depth], decoder, selection, wanted, transform)
            depth += 1
    finally:
        parquet.ROW_GROUPS.clear()  # the trainer keeps no row groups, nor their mappings
        for _, data, _ in opened:
            _unmap(data)
    return found


def _read(found: Probe, data: memoryview, path: str, ref: Any, decoder: Decoder, selection: FieldSelection,
          wanted: set[str] | None, transform: Transform | None) -> None:
    try:
        sample, _ = load_sample(data, path, ref, decoder, selection, wanted, transform, set())
    except UnsafeMemberError as exc:
        raise SettingError("fields", f"{path} sample {ref.key!r}: {exc}") from None
    except Exception as exc:
        found.refused.append((path, ref.key, exc))
        return
    found.samples.append(sample)


def _unmap(data: memoryview) -> None:
    """The shard's mapping closed, where no sample kept a view of it (else the collector closes it)."""
    mapping = data.obj
    with contextlib.suppress(BufferError):
        data.release()
        mapping.close()  # type: ignore[union-attr]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (google) is missing
        return False


def _decoded(extensions: Iterable[str], selection: FieldSelection, wanted: set[str] | None) -> set[str]:
    """The extensions a worker decodes, of those a shard has."""
    exts = set(extensions)
    if selection.extensions is not None:
        return exts & selection.extensions
    return exts if wanted is None else exts & wanted


def _check_packages(decoder: Decoder, extensions: set[str], path: str) -> None:
    """Refuse, before any worker starts, members whose decoder needs a package that is not installed."""
    missing = decoder.missing_packages(sorted(extensions))
    if missing:
        ext, package = next(iter(missing.items()))
        raise SettingError("decode", f"{path} has '.{ext}' members, and decoding them needs the {package} package, "
                                     f"which is not installed: pip install {package} (feedline depends on it; an "
                                     f"install with --no-deps leaves it out), or leave the field out "
                                     f"(fields=[...]), or pass decode={{'{ext}': your_function}}")


def _capacities(found: Probe, selection: FieldSelection, transform: Transform | None) -> dict[str, int]:
    """Longest member per field name, where fields are members as they are (no transform in between)."""
    if transform is not None:
        return {}
    if selection.names is None:
        return dict(found.largest)
    return {name: max(found.largest.get(e, 0) for e in alts) for name, alts in selection.names.items()}


def probe_spec(spec: Spec | Mapping[str, Any] | None, shards: list[str], describe: str,
               code: "WorkerCode", max_errors: float = 0.0,
               share: SharedIndexes | None = None) -> tuple[Spec, list[dict[str, Any]]]:
    """The batch layout, from a copy of the user's code (as a worker gets it) run on the first samples.

    The user's own transform object is never called here, and the training script's ``random`` and
    ``numpy`` streams are left as they were.
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        return resolve_spec(spec, shards, describe, code.decoder, code.selection, code.transform, max_errors, share)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def resolve_spec(spec: Spec | Mapping[str, Any] | None, shards: list[str], describe: str, decoder: Decoder,
                 selection: FieldSelection, transform: Transform | None,
                 max_errors: float = 0.0, share: SharedIndexes | None = None) -> tuple[Spec, list[dict[str, Any]]]:
    """(the declared spec checked against the data, or one inferred from it; the samples probed). ``max_errors``
    is the epoch's failure budget: the probe tries as many samples as it would let go unread."""
    declared = Spec.parse(spec) if spec is not None else None
    if not shards:
        if declared is not None:
            return declared, []
        raise SettingError("spec", "the cache holds no shard yet to infer the batch layout from; pass spec=")
    wanted = declared.sources if declared is not None and transform is None else None
    found = probe(shards, decoder, selection, wanted, transform, max_errors, share)
    if not found.samples:
        if declared is not None:
            return declared, []
        raise SettingError("spec", f"no readable sample in the first shards of {describe} to infer the batch "
                                   f"layout from ({found.tried()}): {why_none(found)}")
    if declared is not None:
        for sample in found.samples:
            _check(declared, sample)
        return declared, found.samples
    try:
        inferred = Spec.infer(found.samples, _capacities(found, selection, transform))
    except ValueError as exc:
        raise SettingError("spec", str(exc)) from None
    log.info("inferred batch spec: %s", ", ".join(
        f"{f.name} {f.dtype}" if f.side else
        f"{f.name} {np.dtype(f.dtype).name}{list(f.shape)}{' variable' if f.variable else ''}"
        for f in inferred.fields))
    return inferred, found.samples


def why_none(found: Probe) -> str:
    """What refused every sample probed, and the fix: the first refusal of the commonest kind, with its count."""
    if not found.refused:
        if found.bad_shards:
            more = f" (and {len(found.bad_shards) - 1} more)" if len(found.bad_shards) > 1 else ""
            return f"no shard of them could be indexed: {found.bad_shards[0].rstrip('.')}{more}; check the shards"
        return "their indexes hold no sample; check the shards (a tar's members are grouped by key: dir/key.ext)"
    too_large = [r for r in found.refused if isinstance(r[2], MemberTooLarge)]
    undecodable = [r for r in found.refused if isinstance(r[2], DecodeError) and not isinstance(r[2], MemberTooLarge)]
    rejected = [r for r in found.refused if isinstance(r[2], SampleRejected)]
    if too_large:
        path, key, exc = too_large[0]
        return (f"{len(too_large)} of them have a member past the bound, as {path} sample "
                f"{key!r}: {exc}. If members are meant to be that large, raise it above them, within what a worker "
                f"may hold (StagingLoader(max_member_bytes=...)); else leave the field out (fields=[...])")
    if undecodable:
        path, key, exc = undecodable[0]
        member = getattr(exc, "member", None)
        return (f"{len(undecodable)} of them have a member that cannot be decoded, as {path} "
                f"sample {key!r}{f' member {member!r}' if member else ''}: {exc}. Check the shards were written whole, leave the field out (fields=[...]), "
                f"or pass decode={{'ext': your_function}}")
    if rejected:
        path, key, exc = rejected[0]
        return (f"{len(rejected)} of them were refused ({exc.reason}), as {path} sample "
                f"{key!r}: {exc}")
    path, key, exc = found.refused[0]
    return (f"reading them raised, as {path} sample {key!r}: {type(exc).__name__}: {exc}. If that is your "
            f"transform's or decoder's error, fix it there")


def _check(spec: Spec, sample: dict[str, Any]) -> None:
    for f in spec.fields:
        if f.source not in sample:
            have = sorted(k for k in sample if not k.startswith("__"))
            raise SettingError("spec", f"field {f.name!r} reads {f.source!r}, which the data does not have "
                                       f"(a sample has {have}); fix the spec's source, fields= or the transform")
        try:
            if f.side:
                encode(f, sample[f.source])
            else:
                fill(f, np.zeros((1,) + f.shape, f.np_dtype), sample[f.source], np.zeros(1, np.int32), 0)
        except SampleRejected as exc:
            raise SettingError("spec", f"does not match the data: {exc} (sample {sample['__key__']!r} of "
                                       f"{sample['__shard__']})") from None


def resolve_side_bytes(side_bytes: int | None, spec: Spec, samples: list[dict[str, Any]]) -> int:
    """The per-sample room for keys, text, JSON and bytes: the setting, or a default; checked on the probe."""
    room = side_bytes or (DEFAULT_SIDE_BYTES if spec.side_fields else KEY_ONLY_SIDE_BYTES)
    for sample in samples:
        sizes = {"__key__": len(str(sample["__key__"]).encode())}
        for f in spec.side_fields:
            try:
                sizes[f.name] = len(encode(f, sample[f.source]))
            except (SampleRejected, KeyError):
                continue
        if sum(sizes.values()) > room:
            detail = ", ".join(f"{k} {v}" for k, v in sizes.items())
            raise SettingError("side_bytes", f"sample {sample['__key__']!r} of {sample['__shard__']} needs "
                                             f"{sum(sizes.values())} bytes for its text, JSON and bytes fields "
                                             f"({detail}), over side_bytes={room} per sample: raise side_bytes")
    return room
