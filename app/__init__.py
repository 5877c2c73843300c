"""feedline: keeps GPUs fed from tar shards through a shared-memory staging loader.

Names are imported lazily so that worker processes, which import ``app`` to
find their entry point, never pay for importing torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["StagingLoader", "LoaderSettings", "DeviceDecode", "Spec", "Field", "Rank", "LoaderError", "SettingError",
           "__version__"]

_LAZY = {
    "StagingLoader": "app.api",
    "LoaderSettings": "app.loader.settings",
    "DeviceDecode": "app.loader.settings",
    "Spec": "app.loader.spec",
    "Field": "app.loader.spec",
    "Rank": "app.loader.rank",
    "LoaderError": "app.loader.errors",
    "SettingError": "app.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
