"""The shard cache on /dev/shm shared by the sampler and the loader."""
