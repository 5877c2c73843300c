"""The staging loader: worker processes, the shared-memory ring, transfer threads."""
