"""Where the training loop is in an epoch, as small plain data: ``state_dict()`` / ``load_state_dict()``.

The state records what the loop *received* — per worker, the batches it had
and the worker's stream position after them — never what the workers had
decoded ahead, so batches in the ring or on the device queue when the state was
taken are simply made again. With the same settings a resumed loader yields
exactly the batches the interrupted one had left, in the same order.

Elastic resume (another worker count or world size), and a resume after some of
the epoch's shards left the cache: the worker streams are deterministic, so
replaying the saved streams over the shards' sample counts (the state's, from a
cache manifest, or the shard indexes) — no decoding — names every sample the
interrupted run delivered; the resumed epoch leaves those out and splits the
rest by the new ranks and workers. Guarantee: every sample of the epoch exactly
once across the old and the new run, as long as the shards did not change in
between; samples of shards gone since are lost, with a warning naming them.

A state keeps its shard list by digest (kilobytes whatever the shard count), and
the names themselves where they may be needed: a growing cache's, a mixture's,
short lists, and once for all ranks in a gathered state (``RANKS_FORMAT``). A
state with the digest alone resumes over the list the loader is given when it is
the same one; over another it is refused (the old plan cannot be rebuilt).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import SettingError
from ...formats.parquet import groups_of, row_group_bytes
from ...formats.shard_index import ShardError, load_index
from ...formats.urls import is_parquet
from .epoch_plan import EpochPlan, epoch_order, part_indexes, shards_digest, split, split_groups, stream_seed
from .mixture import Mixture
from .rank import Rank
from .stream import ShardProblem, order

log = logging.getLogger("feedline.loader")

FORMAT = "feedline.loader/1"
RANKS_FORMAT = "feedline.loader.ranks/1"  # every rank's state in one (state_dict under torch.distributed)
NAMES_KEPT = 4096  # a single rank's state keeps the names of a shard list this long, beyond it their digest
# Settings a state must share with the loader it is loaded into, unless elastic.
EXACT = ("seed", "batch_size", "drop_last", "shuffle", "shuffle_buffer", "shuffle_block", "workers", "rank",
         "world_size")


@dataclass
class Cursor:
    """The loop's progress through one epoch: batches received, and per worker [batches, stream position]."""

    batches: int = 0
    per_worker: list[list[int]] = field(default_factory=list)
    finished: bool = False
    before: int = 0  # batches received before the epoch's rest was split anew (workers="auto")
    expected: int | None = None  # batches the epoch yields (exact when no sample is skipped): reached, it is over

    @classmethod
    def start(cls, workers: int, first: Sequence[int] | None = None,
              delivered: Sequence[int] | None = None) -> "Cursor":
        first = first or [0] * workers
        delivered = delivered or [0] * workers
        return cls(sum(first), [[b, p] for b, p in zip(first, delivered)])

    def regrown(self, workers: int) -> None:
        """The rest of the epoch goes on over ``workers`` new streams; the batches so far stay counted."""
        self.before = self.batches
        self.per_worker = [[0, 0] for _ in range(workers)]

    def record(self, worker: int, batch: int, stream_pos: int) -> None:
        """The loop received batch ``batch`` of ``worker``; a few list stores, on every ``next()``."""
        self.batches += 1
        w = self.per_worker[worker]
        w[0], w[1] = batch + 1, stream_pos


@dataclass(frozen=True)
class Resume:
    """How the next ``iter()`` starts: the epoch's plan, and where each worker goes on from (None: the start)."""

    plan: EpochPlan
    first: list[int] | None = None
    delivered: list[int] | None = None


def make_state(plan: EpochPlan | None, cursor: Cursor | None, next_epoch: int, settings: Mapping[str, Any],
               counts: Mapping[str, int] | None = None, with_shards: bool = True) -> dict[str, Any]:
    """The JSON-serializable state: format, the loader's settings that matter, the plan and the cursor.

    ``counts`` (samples per shard, where the source knows them: a cache's manifest) let a resume replay
    the epoch even after some of its shards are gone: only this rank's own shards' (its replay reads no
    other). The shard list is kept by its digest, and by its names too only ``with_shards`` (a source that
    cannot list them again at load).
    """
    state: dict[str, Any] = {"format": FORMAT, "next_epoch": next_epoch, **settings}
    if plan is None or cursor is None:
        state["plan"] = None
        return state
    own = plan.own_paths() if counts else set()
    state.update(plan=plan.get_state(with_shards), batches=cursor.batches, finished=cursor.finished,
                 per_worker=[list(w) for w in cursor.per_worker],
                 counts={p: n for p, n in (counts or {}).items() if p in own})
    return state


def shared_lists(states: Sequence[Mapping[str, Any]], lists: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The shard lists a gathered state (``RANKS_FORMAT``) keeps once for all ranks, by digest: each list that a
    rank's plan names by its digest alone, from ``lists`` (the lists this rank has)."""
    wanted = {st["plan"].get("shards_digest") for st in states
              if st.get("plan") is not None and "shards" not in st["plan"]}
    return {d: list(lists[d]) for d in sorted(x for x in wanted if x) if d in lists}


def _with_list(state: Mapping[str, Any], lists: Mapping[str, Sequence[str]]) -> Mapping[str, Any]:
    """``state`` with its plan's shard names put back from ``lists`` (by digest) where it holds only the digest."""
    plan = state.get("plan")
    if plan is None or "shards" in plan or plan.get("shards_digest") not in lists:
        return state
    return {**state, "plan": {**plan, "shards": lists[plan["shards_digest"]]}}  # one list for every rank: no copy


def _check_format(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise SettingError("state", f"is not a feedline loader state of format {FORMAT!r} (got {got!r})")


def own_state(state: Mapping[str, Any] | Sequence[Mapping[str, Any]], rank: Rank,
              elastic: bool) -> tuple[Mapping[str, Any] | Sequence[Mapping[str, Any]], bool]:
    """(the state(s) to resume from, elastic?) from what was loaded: a state of every rank (what a trainer such as
    Lightning saves once, from rank 0) gives this rank its own, or all of them for an elastic resume when the
    world size changed."""
    if not isinstance(state, Mapping) and state and isinstance(state[0], Mapping) \
            and state[0].get("format") == RANKS_FORMAT:
        state = state[0]  # the same states, gathered once per rank
    if not isinstance(state, Mapping) or state.get("format") != RANKS_FORMAT:
        return state, elastic
    lists = state.get("shards") or {}  # digest -> names, kept once for every rank that needs them
    ranks = [_with_list(st, lists) for st in state["ranks"]]
    if len(ranks) == rank.world_size and not elastic:
        return ranks[rank.rank], False
    if len(ranks) != rank.world_size:
        log.warning("the state was saved by %d rank(s), this job has %d: resuming elastically (every sample the "
                    "interrupted epoch had not delivered comes once, in another order)", len(ranks), rank.world_size)
    return ranks, True


def differing(state: Mapping[str, Any], settings: Mapping[str, Any]) -> list[str]:
    """The settings a state must share with the loader (``EXACT``) that it does not."""
    return [k for k in EXACT if state.get(k) != settings[k]]


def saved_workers(states: Mapping[str, Any] | Sequence[Mapping[str, Any]], current: int,
                  most: int) -> tuple[int, bool]:
    """``workers="auto"``: (the worker count to load a state with, whether it was taken in the first epoch).

    The saved run's count where this host allows it, so the resume is exact; above the most, the most
    (the rest of the epoch is then replayed over it)."""
    saved = states if isinstance(states, Mapping) else (states[0] if len(states) == 1 else {})
    plan = saved.get("plan")
    first_epoch = plan is None or (int(plan.get("epoch", 0)) == 0 and not saved.get("finished"))
    workers = saved.get("workers")
    if not isinstance(workers, int) or workers < 1 or workers == current:
        return current, first_epoch
    log.info("workers=auto: %d workers, as the saved run had%s", min(workers, most),
             "" if workers <= most else f" ({workers}) at most")
    return min(workers, most), first_epoch


def _mismatches(state: Mapping[str, Any], settings: Mapping[str, Any]) -> list[str]:
    return [f"{k}={state.get(k)!r} (this loader: {settings[k]!r})" for k in differing(state, settings)]


def _shard_changes(saved: Sequence[str], current: Sequence[str]) -> tuple[list[str], list[str]]:
    now = set(current)
    gone = [s for s in saved if s not in now]
    new = sorted(now.difference(saved))
    return gone, new


def plan_resume(states: Mapping[str, Any] | Sequence[Mapping[str, Any]], settings: Mapping[str, Any],
                rank: Rank, current_shards: Sequence[str], growing: bool, elastic: bool,
                local: Callable[[str], str] | None = None) -> tuple[Resume | None, int]:
    """(how the next epoch starts, or None for a fresh one; the number it gets) from saved state(s). ``local``: the
    file a shard is read from (a compressed one's plain copy, made when asked), for the samples a replay counts."""
    many = [states] if isinstance(states, Mapping) else list(states)
    if not many:
        raise SettingError("state", "no state was given")
    for st in many:
        _check_format(st)
    if len(many) > 1 and not elastic:
        raise SettingError("state", f"{len(many)} states (one per rank of the interrupted run) can only be loaded "
                                    f"with elastic=True")
    first = many[0]
    if first["plan"] is None:  # taken before any epoch began
        return None, int(first["next_epoch"])
    epochs = {st["plan"]["epoch"] for st in many if st["plan"] is not None}
    if len(epochs) > 1 or any(st["plan"] is None for st in many):
        raise SettingError("state", f"the states are of different epochs ({sorted(epochs)}); give the states "
                                    f"all ranks saved at the same step")
    plan_state = first["plan"]
    epoch = int(plan_state["epoch"])
    if first.get("sources") != settings.get("sources"):  # the ring carries the source names, or not: never elastic
        raise SettingError("state", f"was saved by a loader reading sources={first.get('sources')!r}, this one reads "
                                    f"sources={settings.get('sources')!r}; load it into a loader of the same "
                                    f"mixture (the weights may differ: they apply from the next epoch)")
    wrong = _mismatches(first, settings)
    if wrong and not elastic:
        raise SettingError("state", f"was saved by a loader with other settings: {', '.join(wrong)}. Load it into a "
                                    f"loader with those settings, or pass elastic=True to resume with every "
                                    f"remaining sample of the epoch exactly once (in another order)")
    current = _Current(current_shards)
    many = [_resolved_list(st, current) for st in many]
    first = many[0]
    plan_state = first["plan"]
    saved = list(plan_state["shards"])
    gone, new = _shard_changes(saved, current_shards)
    if growing:  # evicted from the cache since, but kept on disk while this reader's lease names it (readers.py)
        gone = [s for s in gone if not os.path.exists(s)]
    if gone or new:
        if not growing and not elastic:
            raise SettingError("state", f"the shard list changed since the state was saved ("
                                        f"{len(gone)} gone, {len(new)} new); pass the same shards, or "
                                        f"elastic=True to go on with what is left")
        # the replay reads the saved names: one the list no longer names is read where it is, if it still is (a
        # list given anew; a compressed shard's plain copy, named by a state from before plans named the archives)
        kept: list[str] = []
        lost: list[str] = []
        for s in gone:
            (kept if os.path.exists(s) else lost).append(s)
        if kept:
            log.info("resuming epoch %d: %d of its shards are no longer in the list (%s); read from where the state "
                     "names them", epoch, len(kept), _some(kept))
        if lost:
            log.warning("resuming epoch %d: %d of the epoch's %d shards are gone (%s): their samples not yet "
                        "delivered are lost; the rest of the epoch is delivered as planned", epoch, len(lost),
                        len(saved), _some(lost))
    if all(st["finished"] for st in many):
        return None, epoch + 1
    if not wrong and not gone and len(many) == 1:  # exact: every worker goes on from its stream position
        plan = EpochPlan.from_state(plan_state)
        per_worker = first["per_worker"]
        return Resume(plan, [b for b, _ in per_worker], [p for _, p in per_worker]), epoch
    mixture = Mixture.from_state(plan_state["mixture"]) if plan_state.get("mixture") else None
    fresh = EpochPlan.make(saved, epoch=epoch, seed=int(settings["seed"]), rank=rank, workers=int(settings["workers"]),
                           shuffle=bool(settings["shuffle"]), mixture=mixture,
                           interleaved=int(settings.get("shuffle_block") or 0) > 0)
    delivered = delivered_samples(many, frozenset(e for a in fresh.assignment for e in a), local)
    count = sum(len(v) for v in delivered.values())
    log.info("resume of epoch %d by replay: %d samples of this rank's share were delivered before; the rest goes "
             "to its %d worker(s) (%d rank(s) in all)", epoch, count, settings["workers"], rank.world_size)
    plan = replace(fresh, skip={**fresh.skip, **{entry: tuple(sorted(v)) for entry, v in delivered.items() if v}})
    return Resume(plan), epoch


def _some(paths: Sequence[str]) -> str:
    return ", ".join(paths[:5]) + (", ..." if len(paths) > 5 else "")


class _Current:
    """The source's shard list now, sorted and digested once however many states (one a rank) are resolved."""

    def __init__(self, shards: Sequence[str]):
        self.count = len(shards)
        self._shards = shards
        self._sorted: list[str] | None = None
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest = shards_digest(self._shards)
        return self._digest

    @property
    def names(self) -> list[str]:
        if self._sorted is None:
            self._sorted = sorted(self._shards)
        return self._sorted


def _resolved_list(state: Mapping[str, Any], current: _Current) -> Mapping[str, Any]:
    """``state`` with its plan's shard names: its own, or the source's now when they are the ones its digest
    names; refused, saying so, when the shard list changed and the state kept only its digest."""
    plan = state["plan"]
    if plan is None or "shards" in plan:
        return state
    if current.digest == plan.get("shards_digest"):
        return {**state, "plan": {**plan, "shards": current.names}}
    raise SettingError("state", f"the shard list changed since the state was saved ({plan.get('shards_count')} "
                                f"shards then, {current.count} now, another list): a state keeps the list by its "
                                f"digest only, so the epoch's plan cannot be rebuilt over another one; pass the "
                                f"same shards (a state keeps the names too, and elastic=True then goes on with "
                                f"what is left, for a cache, a mixture, lists of up to {NAMES_KEPT:,} shards, and "
                                f"under torch.distributed)")


def _old_plans(states: Sequence[Mapping[str, Any]],
               only: frozenset[str] | None) -> Iterator[tuple[Mapping[str, Any], EpochPlan]]:
    """(state, its plan) of the interrupted run's ranks that read any of ``only`` (None: all): the epoch's shard
    order is computed once for all of them, and a rank that read none of those entries is not planned at all."""
    orders: dict[tuple[Any, ...], list[str]] = {}
    for st in states:
        p = st["plan"]
        if p.get("mixture"):  # a mixture's order is its draw's, in its state
            plan = EpochPlan.from_state(p)
            if only is None or any(not only.isdisjoint(a) for a in plan.assignment):
                yield st, plan
            continue
        key = (p.get("shards_digest") or tuple(p["shards"]), int(p["seed"]), int(p["epoch"]), bool(p["shuffle"]))
        if key not in orders:
            orders[key] = epoch_order(p["shards"], int(p["seed"]), int(p["epoch"]), bool(p["shuffle"]))
        ordered = orders[key]
        if only is not None and only.isdisjoint(split(ordered, int(p["rank"]), int(p["world_size"]))):
            continue
        yield st, EpochPlan.from_state(p, ordered)


def delivered_samples(states: Sequence[Mapping[str, Any]], only: frozenset[str] | None = None,
                      local: Callable[[str], str] | None = None) -> dict[str, set[int]]:
    """Per plan entry (a shard; in a mixture, a shard in one pass), the sample indexes the interrupted run(s)
    delivered — or that the epoch's draw left out: replayed from the saved streams.

    ``only``: the entries the resuming rank reads (its share of the new split): only the old streams that read
    any of them are replayed, and only their indexes kept, so the work and the memory are in proportion to the
    rank's own share, not to the epoch (DESIGN.md, "Scale")."""
    counts: dict[str, int] = {p: int(n) for st in states for p, n in st.get("counts", {}).items()}

    def samples_of(path: str) -> int:
        if path not in counts:
            try:
                counts[path] = len(load_index(local(path) if local is not None else path).samples)
            except ShardError as exc:
                log.warning("%s; its samples count as not delivered", exc)
                counts[path] = 0
        return counts[path]

    row_groups: dict[str, tuple[list[int], list[int]] | None] = {}

    def unit_of(item: tuple[str, int]) -> tuple[tuple[str, int], int] | None:
        """A Parquet row's row group and its size (the live stream reads row groups by windows:
        ``stream.block_order``)."""
        entry, i = item
        if entry not in row_groups:
            path = plan.path_of(entry)
            try:
                row_groups[entry] = ((groups_of(load_index(path).samples), row_group_bytes(path))
                                     if is_parquet(path) else None)
            except ShardError:
                row_groups[entry] = None
        known = row_groups[entry]
        if known is None or i >= len(known[0]):
            return None
        group = known[0][i]
        return (entry, group), known[1][group] if group < len(known[1]) else 0

    def rows_of(entry: str) -> Sequence[int] | None:
        """Each row's row group for a Parquet file whose parts are whole row groups (``split_groups``)."""
        unit_of((entry, 0))  # reads the file's index and footer once
        known = row_groups[entry]
        return split_groups(plan.path_of(entry), *known) if known is not None else None

    done: dict[str, set[int]] = {}
    for st, plan in _old_plans(states, only):
        for entry, indexes in plan.skip.items():
            if only is None or entry in only:
                done.setdefault(entry, set()).update(indexes)
        skip = {entry: set(v) for entry, v in plan.skip.items()}
        for w, (entries, parts) in enumerate(zip(plan.assignment, plan.parts)):
            taken = st["per_worker"][w][1] if not st["finished"] else float("inf")
            if not taken or (only is not None and only.isdisjoint(entries)):
                continue  # (a stream that read none of the entries asked for is not replayed)
            groups = ([(entry, i) for i in part_indexes(plan.path_of(entry), samples_of(plan.path_of(entry)), (k, n),
                                                         rows_of(entry) if n > 1 else None)
                       if i not in skip.get(entry, ())]
                      for entry, (k, n) in zip(entries, parts))
            seed = stream_seed(plan.seed, plan.epoch, plan.rank.rank, w)
            buffer = int(st["shuffle_buffer"]) if plan.shuffle else 0
            for n, item in enumerate(order(groups, buffer, int(st.get("shuffle_block") or 0), seed, unit_of)):
                if n >= taken:
                    break
                assert not isinstance(item, ShardProblem)
                entry, i = item
                if only is None or entry in only:
                    done.setdefault(entry, set()).add(i)
    return done
