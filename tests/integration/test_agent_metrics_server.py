"""The agent's ``/metrics`` server (prometheus_client's ASGI app under uvicorn): the
agent's registry with the process, platform and GC collectors, and nothing else."""

from __future__ import annotations

import signal

import httpx

from node_agent.metrics import AgentMetrics, MetricsServer


async def test_the_exposition_has_the_agent_and_its_process() -> None:
    sampled: list[bool] = []
    handler = signal.getsignal(signal.SIGTERM)
    server = MetricsServer(
        AgentMetrics(), host="127.0.0.1", port=0, before_scrape=lambda: sampled.append(True)
    )
    await server.start()
    try:
        assert signal.getsignal(signal.SIGTERM) == handler  # SIGTERM stays the agent's
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            r = await client.get("/metrics")
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert int(r.headers["content-length"]) == len(r.content)
            for family in ("process_resident_memory_bytes", "python_info", "node_agent_tx_total"):
                assert f"\n{family}" in r.text, family
            assert sampled
            head = await client.head("/metrics")
            assert (head.status_code, head.content) == (200, b"")
            assert (await client.get("/other")).status_code == 404
            assert (await client.delete("/metrics")).status_code == 405
    finally:
        await server.stop()


async def test_health_and_ready_for_kubelets_http_probes() -> None:
    """Liveness and readiness over plain HTTP: kubelet's gRPC probe speaks no TLS, and
    with mTLS on the gRPC port takes only certificates of the cluster's CA."""
    draining = False
    server = MetricsServer(AgentMetrics(), host="127.0.0.1", port=0, ready=lambda: not draining)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ready")).status_code == 200
            draining = True
            assert (await client.get("/ready")).status_code == 503
            assert (await client.get("/health")).status_code == 200  # alive while draining
    finally:
        await server.stop()
