"""``SidecarSettings``: what the sampler sidecar fetches, into where, how fast — plain values checked once.

Every refusal is a ``SettingError`` naming the setting; the face's ``Config``
builds one from flags and ``FEEDLINE_*`` variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..cache.readers import TOUCH_EVERY
from ..errors import SettingError
from .auth import parse_auth_hosts
from .http import MAX_INDEX_BYTES

DEFAULT_CACHE = "/dev/shm/feedline"
POLICIES = ("grow", "fill")


@dataclass(frozen=True)
class SidecarSettings:
    """The sidecar's knobs (DESIGN.md, Growth policy; docs/sidecar.md)."""

    source: str
    cache: str = DEFAULT_CACHE
    budget: int = 1 << 30
    policy: str = "grow"
    initial_shards: int = 4
    grow_shards: int = 4
    replace_fraction: float = 0.1
    refresh_per_minute: float = 6.0
    fetch_threads: int = 4
    max_mbps: float = 0.0
    fetch_timeout: float = 30.0
    fetch_min_mbps: float = 0.01
    retries: int = 3
    retry_max_seconds: float = 300.0
    auth_header: str = field(default="", repr=False)  # a credential: never in a repr, a log or an error
    auth_header_file: str = ""
    auth_extra_hosts: str = ""  # origins besides the source's own that the auth header may go to (http.py)
    max_index_bytes: int = MAX_INDEX_BYTES
    partition_index: int = 0
    partition_count: int = 1
    seed: int = 0
    min_shards: int = 1
    reader_lease: float = 600.0

    def __post_init__(self) -> None:
        if not str(self.source).strip():
            raise SettingError("source", "is empty: give a URL pattern, an index file or a path")
        checks: tuple[tuple[str, float, float | None], ...] = (
            ("budget", 1, None), ("initial_shards", 1, None), ("grow_shards", 0, None),
            ("replace_fraction", 0, 1), ("refresh_per_minute", 0, None), ("fetch_threads", 1, 64),
            ("max_mbps", 0, None), ("fetch_timeout", 0.1, None), ("fetch_min_mbps", 0, None), ("retries", 0, None),
            ("retry_max_seconds", 1, None), ("partition_index", 0, None),
            ("partition_count", 1, None), ("seed", 0, None), ("min_shards", 1, None),
            ("reader_lease", 0, None), ("max_index_bytes", 1, None))
        for name, low, high in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or (
                    high is not None and value > high):
                allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise SettingError(name, f"must be a number {allowed}, got {value!r}")
        if 0 < self.reader_lease < 2 * TOUCH_EVERY:
            raise SettingError("reader_lease", f"{self.reader_lease:g} s is shorter than two of a loader's lease "
                                               f"renewals ({TOUCH_EVERY:g} s apart): set 0 (off) or at least "
                                               f"{2 * TOUCH_EVERY:g} s")
        if self.policy not in POLICIES:
            raise SettingError("policy", f"must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.auth_header_file and not os.path.isfile(self.auth_header_file):
            raise SettingError("auth_header_file", f"{self.auth_header_file} is not a file (mount the Secret holding "
                                                   f"the header or token there)")
        try:
            parse_auth_hosts(self.auth_extra_hosts)
        except ValueError as exc:
            raise SettingError("auth_extra_hosts", str(exc)) from None
        if self.partition_index >= self.partition_count:
            raise SettingError("partition_index", f"{self.partition_index} is not below partition_count="
                                                  f"{self.partition_count}")
