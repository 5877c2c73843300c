"""The staging loader: tar shards -> worker processes -> shared-memory ring -> transfer threads -> the loop."""
