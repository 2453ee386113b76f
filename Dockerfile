# kv-conductor: two images from one Dockerfile, each with what its role needs.
#   docker build --target conductor -t kv-conductor .         # no torch: FastAPI + gRPC
#   docker build --target agent -t kv-conductor-agent .       # embedded engine + vLLM adapter
#   docker run -p 8000:8000 kv-conductor conductor --host 0.0.0.0 --agents agent:50051
#   docker run kv-conductor-agent agent --host 0.0.0.0 --role both
# For a CPU-only agent image pass the CPU wheel index of PyTorch as PIP_EXTRA_INDEX_URL;
# the default resolves torch from the configured package index.

FROM python:3.11-slim AS sources
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvc ./kvc
COPY conductor ./conductor
COPY node_agent ./node_agent
COPY kvc_cli ./kvc_cli
COPY kvc_sim ./kvc_sim
RUN python -m venv /opt/kvc && /opt/kvc/bin/pip install --upgrade pip

FROM sources AS build-conductor
RUN /opt/kvc/bin/pip install .

FROM sources AS build-agent
ARG PIP_EXTRA_INDEX_URL=""
RUN /opt/kvc/bin/pip install ".[embedded,vllm]"

FROM python:3.11-slim AS runtime
ENV PATH=/opt/kvc/bin:$PATH PYTHONUNBUFFERED=1
RUN useradd --system --uid 10001 --create-home kvc
WORKDIR /home/kvc
ENTRYPOINT ["kvc"]

FROM runtime AS agent
COPY --from=build-agent /opt/kvc /opt/kvc
USER 10001
# agent gRPC, agent /metrics (with --metrics-port 9464)
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["kvc", "probe", "grpc://127.0.0.1:50051"]
CMD ["agent", "--host", "0.0.0.0"]

# The last stage is the default target: the conductor.
FROM runtime AS conductor
COPY --from=build-conductor /opt/kvc /opt/kvc
USER 10001
# conductor HTTP (and /metrics)
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["kvc", "probe", "http://127.0.0.1:8000/health"]
CMD ["conductor", "--host", "0.0.0.0"]
