"""``feedline run``: the user's own training command, started the way the appliance starts its demo.

The container's entrypoint is ``tini -- feedline``; ``feedline run -- python train.py`` (or
``FEEDLINE_TRAIN_CMD``) checks what the trainer needs, waits for the sidecar's cache to hold
``min_shards`` shards, then replaces itself with the command (``exec``): the command is tini's
child, gets SIGTERM from ``docker stop`` or Kubernetes directly, and its exit status is the
container's. Everything else it needs comes through the environment it inherits: the script
builds its loader with ``StagingLoader.from_env(...)``, which reads the same ``FEEDLINE_*``
settings (cache, batch size, workers, device, metrics port) as ``feedline train``.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
from collections.abc import Sequence

from ..api.config import Config, ConfigError

log = logging.getLogger("feedline")

COMMAND_SETTING = "train_cmd (the words after `feedline run --`, or FEEDLINE_TRAIN_CMD)"


def training_command(cfg: Config, argv: Sequence[str]) -> list[str]:
    """The words after ``--``, else ``FEEDLINE_TRAIN_CMD`` split as a shell would; refused when neither."""
    words = list(argv[1:] if argv and argv[0] == "--" else argv)
    if not words and cfg.train_cmd.strip():
        try:
            words = shlex.split(cfg.train_cmd)
        except ValueError as exc:
            raise ConfigError(f"{COMMAND_SETTING}: {cfg.train_cmd!r} cannot be split into words: {exc}") from None
    if not words:
        raise ConfigError(f"run needs a command: {COMMAND_SETTING}, e.g. `feedline run -- python train.py` or "
                          f"FEEDLINE_TRAIN_CMD='torchrun --nproc-per-node 8 train.py'")
    if shutil.which(words[0]) is None:
        raise ConfigError(f"{COMMAND_SETTING}: {words[0]!r} is not an executable on PATH ({os.environ.get('PATH')}); "
                          f"give a full path, or a program the image has (python, torchrun, feedline)")
    return words


def prepare(cfg: Config) -> None:
    """What ``feedline train`` checks before its first batch: pillow-simd, and a cache that is ready."""
    from ..preflight import check_pillow_simd

    simd = check_pillow_simd()
    if simd.ok is False:
        log.warning("%s: %s (%s)", simd.name, simd.detail, simd.fix)
    if cfg.cache:
        from ..cache.mix import part_dir, wait_for_layout
        from ..cache.source import CacheSource

        parts = wait_for_layout(cfg.cache, cfg.wait_timeout)  # a mixing sidecar's cache: every source's part
        for where in [part_dir(cfg.cache, p.name) for p in parts] if parts else [cfg.cache]:
            shards = CacheSource(where).wait_for(cfg.min_shards, cfg.wait_timeout)
            log.info("cache %s is ready: %d shard(s), min_shards=%d", where, len(shards), cfg.min_shards)
    elif not cfg.shards and not cfg.mix:
        log.warning("none of FEEDLINE_CACHE, FEEDLINE_SHARDS or FEEDLINE_MIX is set: the command must find its "
                    "data itself")


def run(cfg: Config, argv: Sequence[str]) -> None:
    """Never returns: the process becomes the training command."""
    command = training_command(cfg, argv)
    prepare(cfg)
    log.info("running: %s", shlex.join(command))
    logging.shutdown()
    os.execvp(command[0], command)
