"""Tar/WebDataset shards: member index, decoders, transforms, writer."""
