"""The device: how a model is prepared for it (prepare), the runner that feeds it batches
from shared-memory slots (runner), compiled packages (packaged) and the CPU process's
malloc settings (malloc_tuning).

torch only: never imports redis or the streams room; results go back as values.
"""
