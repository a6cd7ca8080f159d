"""The serving systems that bench/peers.py compares, one module each, and its load generator.

Every system serves the same model the same way: redbatch's EfficientNet-Lite0 handler
(Pillow decode, resize, crop, normalise; the eager torch forward; softmax top-5), loaded
through :mod:`peer_systems.model`. Each one is started and stopped by the bench.
"""
