"""The loader's epochs: each one's plan, made readable on this rank, and the state that resumes one.

``StagingLoader``'s methods (a mixin, as ``workers/dispatcher.py`` is ``WorkerPool``'s): which shards an epoch
reads and how many batches they make (``len()``, the ranks' agreement), the plain copies and listed counts of a
rank's own shards, and ``state_dict`` / ``load_state_dict`` (``plan/resume.py`` does the arithmetic). The
constructor, the iteration and the resources stay in ``loader.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import LoaderError
from .plan.epoch_plan import EpochPlan
from .plan.epochs import EpochCounter
from .plan.mixture import Source
from .plan.rank import Rank
from .plan.resume import (NAMES_KEPT, RANKS_FORMAT, Cursor, Resume, differing, make_state, own_state, plan_resume,
                          saved_workers, shared_lists)
from .plan.sources import MixedSource, ShardSource, check_counts
from .settings import LoaderSettings

if TYPE_CHECKING:
    from .pipeline import Pipeline
    from .tune.auto import AutoWorkers

log = logging.getLogger("feedline.loader")


class LoaderEpochs:
    """The epoch plans and the resume state of a ``StagingLoader`` (a mixin: they share its attributes)."""

    settings: LoaderSettings
    source: ShardSource
    rank: Rank
    mixture: tuple[Source, ...] | None
    plan: EpochPlan | None  # the current epoch's
    auto_workers: bool
    most_workers: int
    _pipeline: Pipeline
    _epochs: EpochCounter
    _resume: Resume | None
    _cursor: Cursor | None
    _counts: dict[str, int]
    _checked: tuple[EpochPlan, EpochPlan] | None
    _planned: EpochPlan | None
    _auto: AutoWorkers | None
    _stop_auto: Callable[[str | None], None]  # loader.py's: workers="auto" stops adjusting

    # -- the epochs' plans -------------------------------------------------------------------

    def _wait_for_shards(self, least: int, timeout: float) -> list[str]:
        """The source's shards once it holds ``least`` and, from a growing cache, one for every rank: an epoch split
        by ranks over fewer shards than ranks would give some ranks no batch (or, agreed, every rank none)."""
        ranks = self.rank.world_size
        if not self.source.growing or least >= ranks or isinstance(self.source, MixedSource):
            return self.source.wait_for(least, timeout)
        return self.source.wait_for(ranks, timeout, reason=(  # type: ignore[call-arg]
            f"one for each of the {ranks} ranks that split it (else some would have no batch): is `feedline sample` "
            f"filling it, and does its budget hold {ranks} shards (FEEDLINE_BUDGET)? Raise wait_timeout "
            f"(FEEDLINE_WAIT_TIMEOUT), or run fewer ranks or smaller shards"))

    def _next_plan(self) -> EpochPlan:
        """The plan of the epoch the next start reads, made once: ``len()`` before the epoch and the start agree."""
        p, epoch = self._planned, self._epochs.next
        if p is None or p.epoch != epoch or p.workers != self.settings.workers:
            p = self._planned = self._readable(self._plan_epoch(epoch))
        return p

    def _local_files(self, paths: Collection[str]) -> dict[str, str]:
        """The files ``paths`` are read from where they are not the shards themselves (compressed ones' plain
        copies, made now where missing: ``PathSource.local_files``)."""
        local = getattr(self.source, "local_files", None)
        return local(paths) if local is not None else {}

    def _local_file(self, path: str) -> str:
        return self._local_files([path]).get(path, path)

    def _listed(self) -> dict[str, int]:
        """Samples per shard a listing gives (a wids shard index: ``PathSource.listed``)."""
        return getattr(self.source, "listed", None) or {}

    def _readable(self, plan: EpochPlan) -> EpochPlan:
        """``plan`` with the files of the rank's own shards (a compressed shard's plain copy: each rank makes
        those of its own shards, not of every shard), their listed counts checked against their indexes (read
        here once, the workers copy them) before a worker reads a shard the plan counted wrong."""
        if plan.files:
            return plan
        if self._checked is not None and self._checked[0] is plan:
            return self._checked[1]
        own = plan.own_paths()
        files = self._local_files(own)
        out = plan.reading(files) if files else plan
        listed = self._listed()
        if listed:
            pipeline = getattr(self, "_pipeline", None)
            check_counts(listed, sorted(own), pipeline.indexes if pipeline is not None else None, files)
        self._checked = (plan, out)
        return out

    def _batches(self, plan: EpochPlan) -> int:
        """``plan``'s batch count, its shards counted as the manifest had them when the epoch started (or now,
        for an epoch not yet started): the sidecar may evict them while the epoch runs."""
        counts = {**self._listed(), **(self._counts if plan is self.plan else getattr(self.source, "counts", None)
                                       or {})}
        pipeline = getattr(self, "_pipeline", None)  # (none yet while the first plan is made)
        return self._readable(plan).batches(self.settings.batch_size, self.settings.drop_last, counts or None,
                                            pipeline.indexes if pipeline is not None else None)

    def _plan_epoch(self, epoch: int) -> EpochPlan:
        s = self.settings
        if isinstance(self.source, MixedSource) and self.mixture is not None:  # the epoch's draw (mixture.py)
            shards, mix = self.source.draw(self.mixture, seed=s.seed, epoch=epoch, shuffle=bool(s.shuffle))
            return EpochPlan.make(shards, epoch=epoch, seed=s.seed, rank=self.rank, workers=s.workers,
                                  shuffle=bool(s.shuffle), mixture=mix, interleaved=s.block > 0)
        shards = self.source.snapshot()
        if self.source.growing and len(shards) < self.rank.world_size:  # evicted below the ranks: wait for more
            shards = self._wait_for_shards(self.rank.world_size, s.wait_timeout)
        if not shards:
            raise LoaderError(f"no shards to read in {self.source.describe()}")
        return EpochPlan.make(shards, epoch=epoch, seed=s.seed, rank=self.rank, workers=s.workers,
                              shuffle=bool(s.shuffle), interleaved=s.block > 0)

    # -- epochs and resume -------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Name the epoch the next starts read until it is read to its end (``DistributedSampler.set_epoch``);
        without it epochs count up, in one process as under torch.distributed.

        A loaded state for that same epoch is kept: the next start resumes it.
        """
        if self._resume is not None and self._resume.plan.epoch != epoch:
            log.warning("set_epoch(%d): the loaded state of epoch %d is dropped", epoch, self._resume.plan.epoch)
            self._resume = None
        if self._resume is None:
            self._epochs.name(epoch)

    def _state_settings(self) -> dict[str, Any]:
        s = self.settings
        return {"seed": s.seed, "batch_size": s.batch_size, "drop_last": s.drop_last, "shuffle": s.shuffle,
                "shuffle_buffer": s.shuffle_buffer, "shuffle_block": s.block, "workers": s.workers,
                "rank": self.rank.rank,
                "world_size": self.rank.world_size,
                "sources": [m.name for m in self.mixture] if self.mixture is not None else None}

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is: small plain data (JSON), for ``load_state_dict`` in a fresh loader.

        It records the batches the loop received, not those decoded ahead. Taken after the loop received
        batch k, a loader that loads it yields batches k+1... of that epoch, then the next epochs. Under
        torch.distributed (equal batches) it holds every rank's state, so the one a trainer saves from rank 0
        resumes every rank: a collective, called on every rank as Lightning and Accelerate do.
        """
        coordinator = self._pipeline.coordinator
        plan = self._resume.plan if self._resume is not None else self.plan
        if coordinator is None:
            return self._own_state(self._keeps_names(plan))
        ranks = coordinator.gather(self._own_state(names=False))  # every rank calls it: a rank's is kilobytes
        digests = {st["plan"].get("shards_digest") for st in ranks if st["plan"] is not None}
        if len(digests) > 1:  # ranks that split other lists (a cache read at different times): each its own names
            return {"format": RANKS_FORMAT, "ranks": coordinator.gather(self._own_state(names=True))}
        lists = shared_lists(ranks, {plan.digest: plan.shards} if plan is not None else {})
        return {"format": RANKS_FORMAT, "ranks": ranks, **({"shards": lists} if lists else {})}

    def _keeps_names(self, plan: EpochPlan | None) -> bool:
        """A single rank's state keeps the shard names where the source cannot list them again at load (a growing
        cache, a mixture's draw) and for lists of at most ``NAMES_KEPT`` shards (an elastic resume can then go on
        over a folder that changed); above that, their digest, checked against the list the loader is given.
        (Gathered under torch.distributed, the names are kept once for every rank, whatever the source.)"""
        return bool(self.source.growing or self.mixture is not None
                    or (plan is not None and len(plan.shards) <= NAMES_KEPT))

    def _own_state(self, names: bool = True) -> dict[str, Any]:
        c = self._cursor
        if c is not None and self.plan is not None and not c.finished:
            if c.expected is None:  # the epoch's batch count, from the shard indexes, once, when first asked
                c.expected = c.before + self._batches(self.plan)
            if c.batches >= c.expected:  # the last batch is in: trainers that stop by len() call no next()
                c.finished = True
                self._epochs.ended(self._epochs.current)
        if self._resume is not None:  # loaded, not yet iterated: the start of the resumed epoch
            r = self._resume
            cursor = Cursor.start(self.settings.workers, r.first, r.delivered)
            return make_state(r.plan, cursor, r.plan.epoch, self._state_settings(), self._counts, names)
        return make_state(self.plan, self._cursor, self._epochs.next, self._state_settings(), self._counts, names)

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]], elastic: bool = False) -> None:
        """Go on from a saved state at the next ``iter()``.

        The state must come from a loader with the same seed, batch size, drop_last, shuffle settings,
        worker count and rank/world size, over the same shards — or pass ``elastic=True`` (and, when the
        world size changed, the states of all the interrupted run's ranks, as a list): then every sample
        the interrupted epoch had not delivered is delivered exactly once, in another order. Over shards that
        changed since, elastic goes on with what is left where the state kept the shard names (``_keeps_names``);
        a state that kept only their digest is refused.
        """
        state, elastic = own_state(state, self.rank, elastic)
        if self.auto_workers:  # auto takes the saved run's worker count (it had tuned it): the resume is exact
            workers, first_epoch = saved_workers(state, self.settings.workers, self.most_workers)
            if self._auto is not None and not self._auto.adopt(workers, go_on=first_epoch):
                self._auto = None  # tuned in an epoch before: that count stays
            self.settings = self.settings.replace(workers=workers)
            elastic = elastic or isinstance(state, Mapping) and differing(state, self._state_settings()) == ["workers"]
        resume, next_epoch = plan_resume(state, self._state_settings(), self.rank, self.source.snapshot(),
                                         self.source.growing, elastic, local=self._local_file)
        self._resume = resume
        self._planned = None
        self._epochs.load(next_epoch)
        if resume is None:  # before an epoch: nothing of the past run's epochs is in progress here
            self.plan, self._cursor = None, None

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (before iterating: the next one), from the shard indexes.

        Exact when no sample is skipped (corrupt, evicted); without ``drop_last`` each worker's last,
        partial batch counts as one. Under torch.distributed (``equal_batches``) it is the count the ranks
        agreed on, what the loop yields: for the next epoch that agreement happens here, the one all-gather
        the epoch's first batch would otherwise make — so every rank asks, as trainers that size their epoch
        by ``len()`` do.
        """
        coordinator = self._pipeline.coordinator
        if self._resume is not None:
            epoch, batches = self._resume.plan.epoch, self._batches(self._resume.plan)
        elif self.plan is not None and self._cursor is not None and not self._cursor.finished:
            if coordinator is not None and self._cursor.expected is not None:
                return self._cursor.expected
            return self._cursor.before + self._batches(self.plan)
        else:
            if self._auto is not None and self._epochs.current >= 0:  # as the start would: the count stays
                self._stop_auto("the first epoch ended: its worker count stays")
            epoch, batches = self._epochs.next, self._batches(self._next_plan())
        if coordinator is None:
            return batches
        agreed = self._epochs.agreed(epoch)
        if agreed is None:
            agreed = coordinator.agree(epoch, batches)
            self._epochs.remember(epoch, agreed)
        return agreed
