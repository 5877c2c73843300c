"""The library's face: ``StagingLoader`` with its metrics endpoint (``staging_loader.py``), the one typed
configuration (``config.py``: defaults, then ``FEEDLINE_*``, then flags) and the mixture settings it parses
(``mixing.py``). The only library code that knows ``Config``; the appliance and the demo trainer build on it.

``StagingLoader`` is imported on first use, so that ``feedline.api.config`` (the command line's settings)
does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StagingLoader"]


def __getattr__(name: str) -> Any:
    if name in ("StagingLoader", "METRICS_PORT_SETTING"):
        from . import staging_loader

        return getattr(staging_loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
