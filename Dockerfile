# kv-conductor: one image for the conductor and the node agent.
#   docker build -t kv-conductor .
#   docker run -p 8000:8000 kv-conductor conductor --host 0.0.0.0 --agents agent:50051
#   docker run kv-conductor agent --host 0.0.0.0 --role both
# For a CPU-only image pass the CPU wheel index of PyTorch as PIP_EXTRA_INDEX_URL;
# the default resolves torch from the configured package index.

FROM python:3.11-slim AS build
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY conductor ./conductor
COPY node_agent ./node_agent
COPY kvc ./kvc
RUN python -m venv /opt/kvc \
 && /opt/kvc/bin/pip install --upgrade pip \
 && /opt/kvc/bin/pip install ".[embedded]"

FROM python:3.11-slim AS runtime
ENV PATH=/opt/kvc/bin:$PATH PYTHONUNBUFFERED=1
COPY --from=build /opt/kvc /opt/kvc
RUN useradd --system --uid 10001 --create-home kvc
USER 10001
WORKDIR /home/kvc
# conductor HTTP (and /metrics), agent gRPC, agent /metrics (with --metrics-port 9464)
EXPOSE 8000 50051 9464
# The conductor's liveness; agents override it with `kvc probe grpc://127.0.0.1:50051`.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["kvc", "probe", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["kvc"]
CMD ["conductor", "--host", "0.0.0.0"]
