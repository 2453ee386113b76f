# kv-conductor: two images from one Dockerfile, each with what its role needs.
#   docker build --target conductor -t kv-conductor .         # no torch: FastAPI + gRPC
#   docker build --target agent -t kv-conductor-agent .       # embedded engine + vLLM adapter
#   docker run -p 8000:8000 kv-conductor conductor --host 0.0.0.0 --agents agent:50051
#   docker run kv-conductor-agent agent --host 0.0.0.0 --role both
# For a CPU-only agent image pass the CPU wheel index of PyTorch:
#   --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# the default resolves torch from the configured package index. Downloads are kept in
# BuildKit's cache between builds (not in the image), so a source change does not fetch
# torch again. .dockerignore keeps the context to the sources copied below.

FROM python:3.11-slim AS sources
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvc ./kvc
COPY conductor ./conductor
COPY node_agent ./node_agent
COPY kvc_cli ./kvc_cli
COPY kvc_sim ./kvc_sim
# gcc builds the compiled block keys (kvc/_block_keys.c) in the build stages only; the
# runtime stage copies the finished /opt/kvc and carries no compiler.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/kvc && /opt/kvc/bin/pip install --upgrade pip

# The core install: the conductor (and the kvc command), no engine extras.
FROM sources AS build-conductor
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/kvc/bin/pip install .

# The agent: the embedded engine (torch, transformers) and the vLLM adapter (ZMQ, msgpack).
FROM sources AS build-agent
ARG PIP_EXTRA_INDEX_URL=""
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/kvc/bin/pip install ".[embedded,vllm]"

FROM python:3.11-slim AS runtime
ENV PATH=/opt/kvc/bin:$PATH PYTHONUNBUFFERED=1
RUN useradd --system --uid 10001 --create-home kvc \
 && install -d -o kvc -g kvc -m 0750 /certs
WORKDIR /home/kvc
ENTRYPOINT ["kvc"]

FROM runtime AS agent
COPY --from=build-agent /opt/kvc /opt/kvc
USER 10001
# agent gRPC (mTLS: KVC_AGENT_TLS_CERT_FILE, _KEY_FILE, _CA_FILE; docs/security.md),
# agent /metrics, /health and /ready (plain HTTP)
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["kvc", "probe", "http://127.0.0.1:9464/health"]
CMD ["agent", "--host", "0.0.0.0", "--metrics-port", "9464"]

# The last stage is the default target: the conductor.
FROM runtime AS conductor
COPY --from=build-conductor /opt/kvc /opt/kvc
USER 10001
# conductor HTTP (and /metrics)
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["kvc", "probe", "http://127.0.0.1:8000/health"]
CMD ["conductor", "--host", "0.0.0.0"]
