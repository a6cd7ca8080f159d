"""Pure batching policy: which jobs run together and when (batcher, shaping), whose turn
the device is (scheduler), and how many jobs may be in flight (capacity).

No Redis, no torch, no I/O: every rule takes the time as an argument, so a test drives it
with a fake clock.
"""
