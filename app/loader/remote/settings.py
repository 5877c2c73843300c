"""``RemoteDecode``: which Ray cluster decodes, how much of the work it takes, and what to do without it.

Written as an object, or as one string for ``FEEDLINE_REMOTE`` / ``--remote``:
``ADDRESS[,places=N][,cpus=C][,inflight=N][,fallback=local][,connect_timeout=S][,stream=off]`` (``auto``: ``RAY_ADDRESS``, else the cluster a local
``ray start`` joined; or the head's ``host:6379``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Integral, Real
from typing import Any

from ...errors import SettingError

AUTO = "auto"
FALLBACKS = ("error", "local")
INSTALL = "pip install 'feedline[ray]' (Ray 2.60), the same version on every node of the cluster"


@dataclass(frozen=True)
class RemoteDecode:
    """Worker places decoded by actors of a Ray cluster (``remote/proxy.py``); the plan does not change.

    ``places``: how many of the ``workers`` places are remote (the last ones; ``"auto"``: those beyond the CPUs
    the local workers have, at least one); ``cpus``: Ray CPUs an actor asks for; ``inflight``: batches of a place
    sent to its actor and not yet answered (the next one's bytes travel while the actor decodes one; more hides a
    longer round trip, and holds that many more slots' buffers on the actor); ``fallback``: ``"error"``
    refuses to start when no cluster answers at ``address`` within ``connect_timeout`` seconds, ``"local"``
    decodes every place here instead (a warning). A cluster lost mid-run always falls back to local decoding.
    ``stream``: each place talks to its actor on a TCP connection of its own, which the actor opens back to this
    host (``channel.py``); False: through Ray's calls and replies, for networks where decode nodes cannot reach
    this host's ports (slower: more of this host's CPU a batch).
    """

    address: str = AUTO
    places: int | str = AUTO
    cpus: float = 1.0
    inflight: int = 2
    fallback: str = "error"
    connect_timeout: float = 10.0
    stream: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address.strip():
            raise SettingError("remote", f"address must be a Ray address ('auto' or 'host:6379'), got "
                                         f"{self.address!r}")
        object.__setattr__(self, "address", self.address.strip())
        if self.address.startswith("ray://"):
            raise SettingError("remote", f"{self.address}: Ray Client (ray://) would route every batch through the "
                                         f"head; join the cluster as a node instead (`ray start "
                                         f"--address=HEAD:6379 --num-cpus=0` on this machine) and give 'auto' or "
                                         f"HEAD:6379")
        places = self.places
        if isinstance(places, str) and places.strip().isdigit():
            places = int(places)
        if places != AUTO and (not isinstance(places, Integral) or isinstance(places, bool) or places < 1):
            raise SettingError("remote", f"places must be 'auto' or an integer >= 1, got {self.places!r}")
        object.__setattr__(self, "places", places if places == AUTO else int(places))
        if not isinstance(self.cpus, Real) or isinstance(self.cpus, bool) or not 0 < self.cpus <= 256:
            raise SettingError("remote", f"cpus (Ray CPUs an actor asks for) must be a number in (0, 256], "
                                         f"got {self.cpus!r}")
        if not isinstance(self.inflight, Integral) or isinstance(self.inflight, bool) or not 1 <= self.inflight <= 16:
            raise SettingError("remote", f"inflight (batches of a place on their way to its actor) must be an "
                                         f"integer in [1, 16], got {self.inflight!r}")
        object.__setattr__(self, "inflight", int(self.inflight))
        if self.fallback not in FALLBACKS:
            raise SettingError("remote", f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if not isinstance(self.connect_timeout, Real) or not 0 < self.connect_timeout <= 300:
            raise SettingError("remote", f"connect_timeout must be a number of seconds in (0, 300], got "
                                         f"{self.connect_timeout!r}")
        if not isinstance(self.stream, bool):
            raise SettingError("remote", f"stream must be on or off (True or False), got {self.stream!r}")

    @classmethod
    def parse(cls, value: "RemoteDecode | str | dict[str, Any] | None") -> "RemoteDecode | None":
        """A ``RemoteDecode`` from what a user gives: the object, its fields as a dict, the one-string form, or
        None/"" / "off" (no remote decoding)."""
        if value is None or isinstance(value, RemoteDecode):
            return value
        if isinstance(value, dict):
            return cls(**value)
        if not isinstance(value, str):
            raise SettingError("remote", f"give a Ray address string or a RemoteDecode, got {type(value).__name__}")
        text = value.strip()
        if text.lower() in ("", "off", "none"):
            return None
        address, *options = [part.strip() for part in text.split(",")]
        fields: dict[str, Any] = {"address": address}
        for option in options:
            name, sep, raw = option.partition("=")
            name = name.strip()
            if not sep or name not in ("places", "cpus", "inflight", "fallback", "connect_timeout", "stream"):
                raise SettingError("remote", f"{option!r} is not an option: write ADDRESS[,places=N][,cpus=C]"
                                             f"[,inflight=N][,fallback=local][,connect_timeout=S][,stream=off]")
            raw = raw.strip()
            if name == "stream":
                if raw.lower() not in ("on", "off"):
                    raise SettingError("remote", f"stream must be on or off, got {raw!r}")
                fields[name] = raw.lower() == "on"
            elif name == "inflight":
                try:
                    fields[name] = int(raw)
                except ValueError:
                    raise SettingError("remote", f"inflight must be an integer, got {raw!r}") from None
            elif name in ("cpus", "connect_timeout"):
                try:
                    fields[name] = float(raw)
                except ValueError:
                    raise SettingError("remote", f"{name} must be a number, got {raw!r}") from None
            else:
                fields[name] = raw
        return cls(**fields)

    def remote_places(self, workers: int, local_cpus: int) -> tuple[int, ...]:
        """The worker places decoded remotely: the last ``places`` of ``workers`` (``auto``: those beyond the
        local workers' CPUs, at least one)."""
        n = self.places if self.places != AUTO else max(1, workers - local_cpus)
        if n > workers:
            raise SettingError("remote", f"places={n} is more than workers={workers}: the places are the plan's "
                                         f"worker streams, each decoded here or remotely; raise workers or lower "
                                         f"places")
        return tuple(range(workers - int(n), workers))

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "places": self.places, "cpus": self.cpus, "inflight": self.inflight, "fallback": self.fallback,
                "connect_timeout": self.connect_timeout, "stream": self.stream}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RemoteDecode":
        return cls(**d)

    def with_address(self, address: str) -> "RemoteDecode":
        return replace(self, address=address)
