"""One sample from its members into a row of a batch slot: what a worker process and a remote decode actor share.

Both run exactly this code on exactly these bytes, with the sample's own seed, so a batch decoded on another
machine is bit-identical with one decoded here (``remote/``); and both turn a failure into the same reason and
the same words (``rejection``), so a bad sample is skipped and counted alike wherever it was decoded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...formats.decoders import DecodeError, MemberTooLarge
from ...formats.sample_index import Sample
from ...formats.transforms import generators_of
from ..layout.sample import load_sample
from ..layout.side import SideWriter
from ..layout.spec import SampleRejected, fill
from ..ring.batch_ring import RingLayout

RAISE_BOUND = "raise FEEDLINE_MAX_MEMBER_BYTES / --max-member-bytes if this data is meant"


class SampleWriter:
    """Writes samples into slot rows for one ring layout and the user's code (a ``WorkerCode``)."""

    def __init__(self, layout: RingLayout, code: Any):
        self.code = code
        self.fields = layout.fields
        self.columns = [(f, f.name, f.source, f.length_name) for f in self.fields]  # looked up once, not a sample
        self.side = SideWriter(layout.side_fields, layout.side_bytes)
        self.sources = layout.spec.sources
        self.wanted = self.sources if code.transform is None else None
        # the members of array fields, which a slot's write reads once: with no transform between, a Parquet row
        # hands them over as views (a source also read by a side field is not among them)
        slotted = {f.source for f in self.fields} - {f.source for f in layout.side_fields}
        self.views = frozenset(code.selection.sources_of(slotted) if code.transform is None else ())
        # the generators each sample seeds: only a transform draws (plain decoding costs nothing), and only from
        # those it declares (formats/transforms.py)
        self.reseed = generators_of(code.transform)

    def begin(self) -> None:
        """A new batch: side values pack from the start of the slot's side region."""
        self.side.begin()

    def write(self, data: memoryview, path: str, sample: Sample, views: dict[str, np.ndarray], i: int,
              source: str | None) -> tuple[int, int]:
        """(bytes read, bytes written) for ``sample`` as row ``i``; raises what ``rejection`` names."""
        loaded, read = load_sample(data, path, sample, self.code.decoder, self.code.selection, self.wanted,
                                   self.code.transform, self.sources, source, self.views)
        written = 0
        for f, name, source_name, length_name in self.columns:
            written += fill(f, views[name], loaded[source_name], views.get(length_name), i)
        written += self.side.write(views, i, sample.key, loaded, source)  # last: packs, no gaps on a reject
        loaded.clear()
        return read, written


def rejection(exc: Exception) -> tuple[str, str]:
    """(the error reason, what follows "<shard> sample <key>: " in the log) for a sample that failed."""
    if isinstance(exc, SampleRejected):
        return exc.reason, f"{exc}; skipped"
    if isinstance(exc, MemberTooLarge):  # refused before its memory was taken (formats/bounds.py)
        return "member_too_large", f"{exc}; skipped ({RAISE_BOUND})"
    if isinstance(exc, DecodeError):
        return "corrupt", f"{exc}; skipped"
    return "corrupt", f"{type(exc).__name__}: {exc}; skipped"  # a decoder or the user's transform failed
