"""feedline: keeps GPUs fed from tar shards through a shared-memory staging loader.

Names are imported lazily so that worker processes, which import ``feedline`` to
find their entry point, never pay for importing torch. The version comes from the
installed package's metadata, so it is the one ``pip`` shows.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

try:
    __version__ = metadata.version("feedline")
except metadata.PackageNotFoundError:  # the source folder imported without an install
    __version__ = "0+unknown"
__all__ = ["StagingLoader", "Source", "LoaderSettings", "DeviceDecode", "Spec", "Field", "Rank", "LoaderError",
           "SettingError", "__version__"]

_LAZY = {
    "StagingLoader": ".api.staging_loader",
    "Source": ".loader.plan.mixture",
    "LoaderSettings": ".loader.settings",
    "DeviceDecode": ".loader.settings",
    "Spec": ".loader.layout.spec",
    "Field": ".loader.layout.spec",
    "Rank": ".loader.plan.rank",
    "LoaderError": ".loader.errors",
    "SettingError": ".errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
