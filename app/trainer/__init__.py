"""The demo trainer behind ``feedline train``: the training loop (``train.py``), its optimizer (``sgd.py``),
the per-sample key trace (``keytrace.py``), checkpoints (``checkpoint.py``) and torchrun's process group
(``distributed.py``). A user of the library needs none of it; it shows the library used as a training job
uses it, under every fault the tests send."""
