"""The tests' Ray cluster: ``feedline.bench.ray_nodes.RayNodes`` (a real head node on 127.0.0.1, token auth),
and the processes of the actors feedline starts in it."""

from __future__ import annotations

from feedline.bench.ray_nodes import RayNodes as RayCluster, free_port, pids_where  # noqa: F401


def actor_pids(class_name: str = "DecodeActor") -> list[int]:
    """Ray worker processes now running an actor of ``class_name`` (Ray names the process ``ray::Class...``)."""
    return pids_where(lambda cmd: cmd.startswith(f"ray::{class_name}".encode()))
