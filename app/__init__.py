"""feedline: keeps GPUs fed from tar shards through a shared-memory staging loader.

``StagingLoader`` is imported lazily so that worker processes, which import
``app`` to find their entry point, never pay for importing torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["StagingLoader", "Spec", "Field", "LoaderError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("StagingLoader", "LoaderError"):
        from .loader import loader

        return getattr(loader, name)
    if name in ("Spec", "Field"):
        from .loader import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
