"""The shared-memory batch ring (batch_ring) and what the training loop holds of it: zero-copy views that
fail loudly once their slot is given back (views), and slots kept for a batch the loop holds on to (kept)."""
