"""The sampler sidecar."""
