"""docs/scale.md from ``feedline bench scale``'s results."""

from __future__ import annotations

from typing import Any

from .curves import slope

INTRO = """# Scale, by simulation

Written by `feedline bench scale` (issue 71). Every figure so far in [benchmarks.md](benchmarks.md) comes from a
few dozen shards and a few ranks; a large job has a billion samples (N), 100,000 shards (S), 4,096 ranks (R) of
16 workers (W). This machine cannot hold that job's data, but the code that plans, resumes, indexes and caches
it never reads a sample's bytes: it runs here on made-up inputs, at the target's size where it can and on a
curve of smaller sizes where it cannot.

**What is simulated**: one rank's `state_dict` mid-epoch (the loader's own `make_state`, a cache's sample counts,
the skip lists an elastic resume leaves); one rank's epoch start over a folder of S real tiny tar shards in
`/dev/shm` (the source's listing, the plan, the batch count `len()` asks for), with each `stat`, directory read
and file opened counted, since on a shared filesystem each is a round trip to its metadata server, and the same
for a two-source mixture (its draw); a shard index of real tar headers (`load_index`), its memory measured with
`tracemalloc`, and a real loader of W worker processes counting how often each index was built; the sidecar's `CacheStore.publish`
filling a cache of C tiny shards on tmpfs (fsyncs included); an elastic resume R -> R/2 of an epoch half
delivered, for one rank of the new run (`plan_resume`), its time and the most memory it allocates (traced with
`tracemalloc`, in a second run); a rank's state as a checkpoint's gather holds it, the shard list by its digest
(the names kept once for all ranks, their size given beside). Each point runs
in a process of its own.

**What is not**: real ranks (one rank's share is computed; every rank does the same), a shared filesystem's
latency (calls are counted, not timed there), the network of a gather (sizes are computed: a rank's state times
R, and the shard names once), a real store's listing, and decoding. Not built: a mixture of sources given
without counts (shard files, not a `shardindex.json` or a cache) still reads every shard's index on every rank
at each epoch start (section 3's mixture table: "the shards"; compressed ones are decompressed to be counted). A curve's **slope** is its log-log slope: 1 grows with the size, 2 with
its square. A figure marked *curve extended* is the largest point carried to the target along that slope.
"""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, str]]) -> list[str]:
    out = ["| " + " | ".join(title for title, _ in cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(key, r.get("error", "—"))) for _, key in cols) + " |")
    return out + [""]


def _calls_named(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured row's metadata calls by name, as its "of which" column reads them."""
    for r in rows:
        if "by_call" in r:
            r["what"] = ", ".join(f"{k} {v:,}" for k, v in sorted(r["by_call"].items()))
    return rows


def markdown(d: dict[str, Any]) -> str:
    t = d["target"]
    lines = [INTRO, f"{d['when']}; {d['host']}; target N = {t['N']:.0e}, S = {t['S']:.0e}, R = {t['R']}, "
                    f"W = {t['W']}{' (--quick: small points, a check, not a measurement)' if d.get('quick') else ''}.",
             "", "## Targets", "", "| part | target | this run | met |", "|---|---|---|---|"]
    for r in d["targets"]:
        met = "—" if r["met"] is None else "yes" if r["met"] else "**no**"
        lines.append(f"| {r['part']} | {r['target']} | {r['value']} | {met} |")
    lines += ["", "## 1. The state a rank saves", "",
              f"One rank's state mid-epoch, N = 1e8 samples over S shards (slope over S: "
              f"{slope(d['state'], 'S', 'bytes') or 0:.2f}):", ""]
    for r in d["state"]:
        if "bytes" in r:
            r["gathered_mib"] = (r["bytes"] * r["R"] + r.get("list_bytes", 0)) / 2**20
            r["kib"] = r["bytes"] / 1024
            r["ms"] = r["seconds"] * 1e3
    lines += _table(d["state"], [("S", "S"), ("state a rank (KiB)", "kib"), ("built in (ms)", "ms"),
                                 ("gathered at R (MiB, the shard names once)", "gathered_mib")])
    for r in d["state_resumed"]:
        if "bytes" in r:
            r["kib"] = r["bytes"] / 1024
    lines += [f"After an elastic resume (a rank's plan lists the samples of its own shards delivered before it, as runs of indexes), S = 1e3 (slope over "
              f"N: {slope(d['state_resumed'], 'N', 'bytes') or 0:.2f}):", ""]
    lines += _table(d["state_resumed"], [("N", "N"), ("state a rank (KiB)", "kib")])
    lines += ["## 2. Elastic resume", "",
              f"R ranks' states of an epoch half delivered, loaded by rank 0 of R/2, S = 1e3, 4 workers a rank; over N "
              f"(slope {slope(d['elastic'], 'N', 'seconds') or 0:.2f} in time, "
              f"{slope(d['elastic'], 'N', 'peak_mib') or 0:.2f} in memory); the rank replays only the old streams "
              f"that read its own new share's shards (with the same seed, those of two old ranks), and keeps only "
              f"their indexes:", ""]
    lines += _table(d["elastic"], [("N", "N"), ("R", "R"), ("seconds", "seconds"), ("memory allocated at most (MiB)",
                                                                                     "peak_mib")])
    lines += [f"Over R at N = 1e6 (slope {slope(d['elastic_ranks'], 'R', 'seconds') or 0:.2f} in time):", ""]
    lines += _table(d["elastic_ranks"], [("R", "R"), ("seconds", "seconds"), ("memory allocated at most (MiB)",
                                                                             "peak_mib")])
    lines += ["## 3. Epoch start", "", "One rank of 4096 (its middle one) over S real tiny shards in a folder "
              f"(slope over S: {slope(d['epoch_start'], 'S', 'seconds') or 0:.2f} in time, "
              f"{slope(d['epoch_start'], 'S', 'calls') or 0:.2f} in calls):", ""]
    _calls_named(d["epoch_start"])
    lines += _table(d["epoch_start"], [("S", "S"), ("seconds", "seconds"), ("metadata calls", "calls"),
                                       ("of which", "what"), ("its shards", "rank_shards")])
    mixed = d.get("mixture_start") or []
    if mixed:
        for r in _calls_named(mixed):
            r["given"] = "shardindex.json (counts listed)" if r.get("listed") else "the shards (each index read)"
        lines += ["", "The same rank's epoch start of a two-source mixture over those shards (half each): the draw "
                  "needs every shard's sample count on every rank, from the sources' webdataset shard indexes "
                  "(`shardindex.json`, the counts listed) or from every shard's index:", ""]
        lines += _table(mixed, [("S", "S"), ("sources given as", "given"), ("seconds", "seconds"),
                                ("metadata calls", "calls"), ("of which", "what")])
    packed = d.get("compressed_start") or []
    if packed:
        _calls_named(packed)
        lines += ["", "The same rank over S tiny `.tar.gz` shards: every rank splits the same names, and each makes "
                  "the plain copies (in `decompress_dir`) of the shards it reads:", ""]
        lines += _table(packed, [("S", "S"), ("seconds", "seconds"), ("metadata calls", "calls"),
                                 ("of which", "what"), ("its shards", "rank_shards"), ("plain copies made", "copies")])
    lines += ["## 4. Shard indexes", "", "A shard of S samples (two members each) indexed from its tar headers:", ""]
    lines += _table(d["index"], [("samples", "S"), ("bytes a sample", "bytes_per_sample")])
    ib = d.get("index_builds") or {}
    if "built" in ib:
        lines += ["", f"A real loader of {ib['W']} workers over {ib['S']} tar shards of {ib['samples']} samples with no "
                  f"index files, one epoch of the default epoch shuffle (each worker reads its part of every shard, so "
                  f"each needs every index): {ib['built']:,} indexes built ({ib['builds_per_shard']:.2f} a shard; "
                  f"without sharing, {ib['W']} a shard), {ib['copied']:,} copied from the loader's shared index "
                  f"memory (~20 ns a sample, against ~2.4 µs to parse a JSON index and ~20 µs to scan a tar's "
                  f"headers); the epoch took {ib['seconds']:.1f} s with the workers' start. The index the trainer "
                  f"reads at the start (the layout probe, `len()`) is one of those built.", ""]
    lines += ["## 5. The sidecar filling its cache", "",
              f"C tiny shards published one by one (slope over C: {slope(d['fill'], 'C', 'seconds') or 0:.2f}); a publish "
              f"appends one line to manifest.log, folded into manifest.json when the log has as many lines as it has "
              f"shards (at 64, 128, 256, ...):", ""]
    lines += _table(d["fill"], [("C", "C"), ("seconds in all", "seconds"), ("a publish at the end (ms)",
                                                                           "last_publish_ms"),
                                ("manifest.json + manifest.log bytes", "manifest_bytes")])
    ro = d["ranks_over_shards"]
    lines += ["## 6. More ranks than shards", "",
              f"A loader of rank {ro['R'] - 1} of {ro['R']} over a cache of {ro['S']} tiny shards (`wait_timeout` 2 s):",
              "", f"- the cache holds the whole source: {ro.get('complete', ro.get('error'))}",
              f"- the cache is still growing: {ro.get('growing', ro.get('error'))}", "",
              "## 7. Rank agreement", "",
              "R real ranks (processes on 127.0.0.1, gloo): the loader's own process group made beside the default one "
              "(the sockets it adds to a rank), an epoch's agreement (an all-gather of two numbers a rank), and a "
              "gather of 64 KiB states (`state_dict` under torch.distributed; at today's state size a rank's is 7 MB "
              f"at 1e5 shards, section 1). Slopes over R: {slope(d.get('agreement', []), 'R', 'agree_ms') or 0:.2f} "
              f"in time, {slope(d.get('agreement', []), 'R', 'group_sockets') or 0:.2f} in sockets. The ranks share "
              "this machine's CPUs: past as many ranks as CPUs, the times say as much about that sharing as about "
              "gloo. The sockets do not: gloo connects every pair of a group's ranks.", ""]
    lines += _table(d.get("agreement", []), [("R", "R"), ("group made (s)", "group_seconds"),
                                             ("its sockets a rank", "group_sockets"),
                                             ("agreement (ms)", "agree_ms"), ("state gather (s)", "gather_seconds"),
                                             ("gathered a rank (bytes)", "gathered_bytes")])
    return "\n".join(lines)
