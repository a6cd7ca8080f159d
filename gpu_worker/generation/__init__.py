"""Continuous batching of a generative model: the per-step scheduler (pure), the KV cache's
blocks and prefix cache (pure), the model's forward pass over them (torch), sampling, text
deltas, and the engine whose ``step()`` ties them together. Never imports redis.
"""
