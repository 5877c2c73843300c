"""What a sample becomes in a batch: the fields and their slots (spec), values beside the slot (side, tree),
and the decoded sample a transform sees (sample). Imports nothing else of the loader."""
