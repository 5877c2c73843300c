"""Where the training process and its decode workers run: the host's CPUs (host), the plan (placement), and
pinning them there (pinning)."""
