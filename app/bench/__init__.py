"""The benchmark against torch DataLoader and webdataset."""
