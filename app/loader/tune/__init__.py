"""``workers="auto"`` and ``transfer_threads="auto"``: the host's defaults (autotune), the first epoch's
growth policy (tuner) and carrying it out on the pool (auto)."""
