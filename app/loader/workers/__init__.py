"""The decode worker processes and their supervision: the wire format (messages), starting a fresh interpreter
(launch), the worker itself (worker), which slot is filled and taken next (scheduler), lifetimes and
replacement (supervisor), the dispatcher that ties them together (pool), and the trainer-side probe of
the batch layout (probe)."""
