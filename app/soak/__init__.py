"""``feedline soak``: the appliance for an hour (or a given time) under a schedule of faults, measured.

A store, the sampler sidecar, the trainer and (when installed) Prometheus run as
real processes; a decode worker is SIGKILLed every few minutes, the sidecar is
SIGKILLed and restarted, the store goes down for a while, the trainer is SIGTERMed
and resumed from its checkpoint. Every few seconds each process's memory, open
descriptors and threads, ``/dev/shm`` and the cache are sampled; at the end the
slopes after the warm-up, the throughput and every epoch's keys are checked
against the targets, and a table and a chart are written (docs/reliability.md).

  faults.py   the schedule of faults over the run
  probe.py    reading a process's RSS, PSS, descriptors and threads from /proc
  run.py      the processes, the loop, the faults carried out; owns everything it starts
  analysis.py slopes, throughput, the epochs' keys, the verdict
  chart.py    the PNG chart (Pillow: no plotting package needed)
"""
