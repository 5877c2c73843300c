"""The appliance: the ``feedline`` command (``cli.py``) and what only it runs — ``feedline run`` wrapping a
user's training command (``run.py``), ``feedline doctor`` (``doctor.py``), and the signals that stop a
command cleanly (``stopping.py``)."""
