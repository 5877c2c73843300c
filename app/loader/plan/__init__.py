"""The epoch's plan: this rank (rank), the shard list (sources), which worker reads which shards in which
order (epoch_plan, stream), the per-sample seeds (seeding), the epoch number (epochs), the ranks' agreement
(coordinate), and the resume state (resume). Plain data: no process, thread or shared memory here."""
