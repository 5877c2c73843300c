"""``feedline sample``: the sampler sidecar (or a mixture's) behind its metrics endpoint until stopped.

How it ends is the process's business, not the library's: with ``remove_cache_on_exit`` (the loader's own
sidecar, whose trainer may die without a word) the cache goes however the sidecar stopped, and a download
that an object store's client cannot cut mid-read (``Sidecar.stuck``) is left behind by ``os._exit``, as
the interpreter would otherwise join its thread until the client's own timeout.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

from ..api.config import Config
from ..errors import SettingError

log = logging.getLogger("feedline")


def sample(cfg: Config, stopping: threading.Event, on_stop: Callable[[Callable[[], None]], None]) -> int:
    """Run the sidecar; ``stopping`` is set by a stop that came during the start, ``on_stop(fn)`` routes the
    stop signals to ``fn``. Returns the exit code."""
    from ..demo.datasets import DEMO_STORE, NO_DEMO_STORE
    from ..sampler.mixed import mixture_of

    settings = cfg.sidecar_settings()
    demo = DEMO_STORE in cfg.source
    if demo:
        log.info("FEEDLINE_SOURCE is unset in compose: the demo dataset, from %s (%s)", DEMO_STORE, NO_DEMO_STORE)
    mixture = mixture_of(settings.source)  # "NAME=SOURCE@WEIGHT ...": one part of the cache per source
    try:
        code, stuck = _run(cfg, settings, mixture, stopping, on_stop, demo)
    finally:
        if cfg.remove_cache_on_exit:  # however it ended: every download stopped, or is left behind (stuck)
            shutil.rmtree(settings.cache, ignore_errors=True)
    if stuck:
        logging.shutdown()
        os._exit(code)
    return code


def _run(cfg: Config, settings: Any, mixture: list[Any], stopping: threading.Event,
         on_stop: Callable[[Callable[[], None]], None], demo: bool) -> tuple[int, bool]:
    from ..demo.datasets import NO_DEMO_STORE
    from ..metrics.catalog import SAMPLER
    from ..metrics.exporter import Exporter
    from ..sampler.mixed import MixedSidecar
    from ..sampler.sidecar import Sidecar

    with Exporter(SAMPLER, cfg.metrics_addr, cfg.port(9101), setting=Config.describe("metrics_port"),
                  ready=lambda: (False, "starting: listing the source"),
                  parts=("source", *(m.name for m in mixture)) if mixture else None) as exporter:
        try:
            sidecar: Sidecar | MixedSidecar = (MixedSidecar(settings, mixture, exporter.sink) if mixture
                                               else Sidecar(settings, exporter.sink))
            exporter.server.ready = sidecar.ready
            on_stop(sidecar.stop)
            if stopping.is_set():
                return 0, False
            return sidecar.run(), bool(sidecar.stuck)
        except SettingError as exc:
            if demo and exc.setting == "source":  # the usual cause: the demo profile is not running (yet)
                raise SettingError("source", f"{exc.message}; {NO_DEMO_STORE}") from None
            raise
