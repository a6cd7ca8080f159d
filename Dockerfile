# A CUDA-capable PyTorch base; the package's torch range (>=2.1) accepts the torch it ships.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

WORKDIR /app
COPY pyproject.toml README.md PROTOCOL.md __init__.py py.typed ./
COPY common ./common
COPY producer ./producer
COPY gpu_worker ./gpu_worker
COPY preproc_worker ./preproc_worker
RUN pip install --no-cache-dir ".[worker]"

# Run as an unprivileged user; SIGTERM lets the worker drain (see stop_grace_period).
RUN useradd --create-home redbatch
USER redbatch
STOPSIGNAL SIGTERM
CMD ["redbatch", "worker"]
