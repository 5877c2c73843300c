"""Worker places decoded by Ray actors on CPU machines beside the GPU one (``remote=``; docs/remote.md).

``settings`` (what the user asks for), ``cluster`` (finding it, without Ray, in the training process),
``proxy`` (the worker process of a remote place), ``link`` (its connection and actor), ``slots`` (the slots'
own TCP stream from actor to proxy), ``actor`` (the remote side). Only ``link`` and ``proxy`` import Ray, and
only in proxy processes.
"""
