"""The worker's Redis I/O: reading jobs (intake, reclaim, partitions), writing answers
(results, transaction) and what it tells the fleet (heartbeat, sampler).

Nothing here imports torch, and the batching and device rooms never import this one.
"""
