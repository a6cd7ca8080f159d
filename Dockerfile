# The worker image. Its install matches CI's (scripts/setup.sh): torch first, then the
# package with its worker extra (CI adds `test`); tests/test_compose.py checks the two agree.
# A CUDA-capable PyTorch base (torch 2.5.1, CUDA 12.4); the package accepts torch>=2.1, so
# pip keeps the base's torch and adds only the rest.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# A C++ compiler: on CPU, calibration tries torch.compile (inductor builds C++ kernels),
# about 1.9x the eager model for EfficientNet-Lite0; without one it is skipped.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# Only what the package build reads: metadata, the readme it names, and the package folders.
COPY pyproject.toml README.md PROTOCOL.md __init__.py py.typed ./
COPY cli ./cli
COPY common ./common
COPY producer ./producer
COPY handlers ./handlers
COPY gpu_worker ./gpu_worker
COPY preproc_worker ./preproc_worker
# Package data: calibration checks a variant's answers on the sample photos.
COPY samples ./samples
RUN pip install --no-cache-dir ".[worker]"

# Run as an unprivileged user; SIGTERM lets the worker drain (see stop_grace_period).
RUN useradd --create-home redbatch
USER redbatch
ENV REDBATCH_METRICS_PORT=9400
EXPOSE 9400
STOPSIGNAL SIGTERM
CMD ["redbatch", "worker"]
