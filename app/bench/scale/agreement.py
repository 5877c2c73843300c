"""Rank agreement with real gloo ranks (issue 71, part 7): one rank of ``R`` processes on 127.0.0.1, each running the
loader's own ``RankCoordinator`` (its process group beside the training's, one all-gather an epoch) and the state
gather ``state_dict`` makes under torch.distributed (``gather_json``), timed; what the group costs in sockets.

``python -m feedline.bench.scale.agreement RANK WORLD PORT STATE_BYTES``: rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _sockets() -> int:
    """This process's open sockets (its descriptors that are sockets)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def main(argv: list[str]) -> None:
    rank, world, port, state_bytes = (int(a) for a in argv[:4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    from ...loader.plan.coordinate import RankCoordinator, gather_json

    dist.init_process_group("gloo", rank=rank, world_size=world)
    before = _sockets()
    t0 = time.perf_counter()
    coordinator = RankCoordinator("drop")
    made = time.perf_counter() - t0
    sockets = _sockets() - before
    coordinator.agree(0, 10)  # the first exchange opens what is opened lazily
    rounds = 5
    t0 = time.perf_counter()
    for epoch in range(1, rounds + 1):
        coordinator.agree(epoch, 10 + rank % 3)
    agree = (time.perf_counter() - t0) / rounds
    doc = {"rank": rank, "pad": "x" * max(0, state_bytes - 40)}
    t0 = time.perf_counter()
    states = gather_json(doc, world, coordinator._group)
    gather = time.perf_counter() - t0
    assert len(states) == world
    all_sockets = _sockets()
    coordinator.close()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"R": world, "group_seconds": made, "group_sockets": sockets, "sockets": all_sockets,
                          "agree_ms": agree * 1e3, "agree_bytes": 16 * world, "state_bytes": state_bytes,
                          "gather_seconds": gather, "gathered_bytes": state_bytes * world}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
