"""The demo appliance and its stand-ins, also used by the benchmark and the tests (nothing a user imports).

``job`` runs the main job (``feedline demo``); ``store`` is the stand-in remote
store (``feedline serve``, with fault injection for tests); ``s3store`` a local
S3-compatible server (moto); ``prometheus`` a
local Prometheus with the project's rules; ``datasets`` the demo and benchmark
datasets; ``procs`` process and port helpers.
"""
