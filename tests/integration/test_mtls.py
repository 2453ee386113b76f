"""mTLS on every gRPC hop and authorization by the role in the caller's certificate:
conductors run transactions and generations, agents only pull KV from each other — and
with node certificates only what a conductor granted their own node —, a caller without
a certificate of the cluster's CA gets nothing, and plaintext is served and dialled on
loopback only (unless a mesh encrypts: ``grpc_plaintext=any``)."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from pathlib import Path

import grpc
import pytest

from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.tls import AGENT_NAME, PlaintextPolicy, TlsFiles, write_bundle
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.server import AgentServer
from node_agent.settings import AgentSettings
from tests.conftest import (
    MODEL,
    AgentFactory,
    ConductorFactory,
    assert_no_locks,
    chat_body,
    rpc_status,
    tls_settings,
)

NODES = ("src", "dst", "rogue")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    write_bundle(out, nodes=NODES)  # agent-src.pem, … name their node
    return out


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("other")
    write_bundle(out)
    return out


def files_of(folder: Path, role: str) -> TlsFiles:
    return TlsFiles(folder / f"{role}.pem", folder / f"{role}-key.pem", folder / "ca.pem")


@pytest.fixture
async def tls_agent(start_agent: AgentFactory, certs: Path) -> AgentServer:
    return await start_agent("both", capacity_blocks=32, **tls_settings(certs, "agent"))


def secure(address: str, files: TlsFiles) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(
        address,
        files.channel_credentials(),
        options=[("grpc.ssl_target_name_override", AGENT_NAME)],
    )


def alloc(tx_id: str) -> pb.TxAllocateRequest:
    return pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT, tx_id=tx_id, tenant="t", block_keys=[11, 12], lease_s=30
    )


async def test_the_conductor_role_may_do_everything_an_agent_only_pull(
    tls_agent: AgentServer, certs: Path
) -> None:
    address = tls_agent.address
    async with secure(address, files_of(certs, "conductor")) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        await stub.TxAllocate(alloc("c1"))
        await stub.Snapshot(pb.SnapshotRequest())
        await stub.TxAbort(pb.TxAbortRequest(tx_id="c1"))
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with secure(address, files_of(certs, "agent")) as channel:
        peer = pb_grpc.NodeAgentStub(channel)
        assert (await peer.GetInfo(pb.GetInfoRequest())).node_id
        assert await rpc_status(peer.TxAllocate(alloc("a1"))) == denied
        assert await rpc_status(peer.Snapshot(pb.SnapshotRequest())) == denied
        assert await rpc_status(peer.Drain(pb.DrainRequest())) == denied
        watch = peer.WatchEvents(pb.WatchEventsRequest(from_seq=1))
        assert await rpc_status(watch) == denied
        generate = peer.Generate(pb.GenerateRequest(request_id="g", prompt_token_ids=[1, 2]))
        assert await rpc_status(generate) == denied
        prefill = peer.Prefill(pb.PrefillRequest(request_id="p", prompt_token_ids=[1, 2]))
        assert await rpc_status(prefill) == denied
        pull = pb.PullBlocksRequest(tx_id="c", source_address="x:1", source_tx_id="s", num_blocks=1)
        assert await rpc_status(peer.PullBlocks(pull)) == denied  # no poisoning by a peer
        assert await rpc_status(peer.TxCommit(pb.TxCommitRequest(tx_id="c1"))) == denied
        # Pulling is an agent's right, and still needs a staged handle of the tenant.
        fetch = peer.FetchKv(pb.FetchKvRequest(stage_handle="guess", tenant="t"))
        assert await rpc_status(fetch) == grpc.StatusCode.NOT_FOUND
    assert not tls_agent.service.draining
    assert_no_locks(tls_agent)


async def test_callers_without_a_certificate_of_the_ca_get_nothing(
    tls_agent: AgentServer, certs: Path, other_ca: Path
) -> None:
    address = tls_agent.address
    unavailable = grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(address) as channel:  # plaintext
        call = pb_grpc.NodeAgentStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
        assert await rpc_status(call) == unavailable
    server_only = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    options = [("grpc.ssl_target_name_override", AGENT_NAME)]
    async with grpc.aio.secure_channel(address, server_only, options=options) as channel:
        call = pb_grpc.NodeAgentStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
        assert await rpc_status(call) == unavailable  # no client certificate
    async with secure(address, files_of(other_ca, "conductor")) as channel:
        tx = pb_grpc.NodeAgentStub(channel).TxAllocate(alloc("x"), timeout=5)
        assert await rpc_status(tx) == unavailable  # another CA's conductor
    assert_no_locks(tls_agent)


async def test_disaggregated_serving_end_to_end_over_mtls(
    start_agent: AgentFactory, conductor: ConductorFactory, certs: Path
) -> None:
    prefill = await start_agent("prefill", **tls_settings(certs, "agent"))
    decode = await start_agent("decode", **tls_settings(certs, "agent"))
    async with conductor([prefill, decode], **tls_settings(certs, "conductor")) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body("hello " * 60))
        assert resp.status_code == 200, resp.text
    assert decode.service.metrics.transfer_bytes.labels("received", "handoff")._value.get() > 0
    assert_no_locks(prefill, decode)


def named(certs: Path, node: str) -> dict[str, str]:
    """An agent's settings as node ``node`` with its own certificate."""
    return {"node_id": node, **tls_settings(certs, f"agent-{node}")}


async def staged_and_locked(stub: pb_grpc.NodeAgentAsyncStub) -> tuple[str, str, list[int]]:
    """As a conductor: a prefill staged for node "dst", and its cached blocks locked
    for "dst" to read. Returns (stage handle, read token, keys)."""
    prompt = [10 + (7 * i) % 1500 for i in range(3 * 32 + 5)]
    keys = [int(k) for k in compute_block_keys(prompt[:-1], tenant="t", model=MODEL, block_size=32)]
    tx = pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT, tx_id="p", tenant="t", block_keys=keys, lease_s=30
    )
    staged = await stub.Prefill(
        pb.PrefillRequest(
            request_id="r", tenant="t", tx_id="p", prompt_token_ids=prompt, tx=tx, grantee="dst"
        )
    )
    lock = pb.TxAllocateRequest(key_layout=KEY_LAYOUT,
        tx_id="l", tenant="t", block_keys=keys, lease_s=30, mode=pb.TX_MODE_LOCK_ONLY,
        grantee="dst",
    )  # fmt: skip
    return staged.stage_handle, (await stub.TxAllocate(lock)).read_token, keys


async def test_a_pull_grant_serves_only_the_node_it_was_bound_to(
    start_agent: AgentFactory, certs: Path
) -> None:
    """A rogue agent of the cluster holding a grant meant for another node (stolen from
    a log, or guessed from a reused one) reads nothing; the granted node still can."""
    source = await start_agent("prefill", **named(certs, "src"))
    async with secure(source.address, files_of(certs, "conductor")) as channel:
        handle, token, keys = await staged_and_locked(pb_grpc.NodeAgentStub(channel))
    fetch = pb.FetchKvRequest(stage_handle=handle, tenant="t")
    read = pb.ReadBlocksRequest(tx_id="l", tenant="t", block_keys=keys, read_token=token)
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with secure(source.address, files_of(certs, "agent-rogue")) as channel:
        rogue = pb_grpc.NodeAgentStub(channel)
        assert await rpc_status(rogue.FetchKv(fetch)) == denied
        assert await rpc_status(rogue.ReadBlocks(read)) == denied
    async with secure(source.address, files_of(certs, "agent-dst")) as channel:
        granted = pb_grpc.NodeAgentStub(channel)
        assert sum(len(c.data) for c in [c async for c in granted.FetchKv(fetch)]) > 0
        assert sum(len(c.data) for c in [c async for c in granted.ReadBlocks(read)]) > 0
    # An agent certificate that names no node (the shared one) is let through unless
    # the serving agent requires node certificates (below).
    async with secure(source.address, files_of(certs, "agent")) as channel:
        assert [c async for c in pb_grpc.NodeAgentStub(channel).ReadBlocks(read)]
    async with secure(source.address, files_of(certs, "conductor")) as channel:
        await pb_grpc.NodeAgentStub(channel).TxAbort(pb.TxAbortRequest(tx_id="l"))
    assert_no_locks(source)


async def test_requiring_node_certificates(start_agent: AgentFactory, certs: Path) -> None:
    """Strict mode: a puller must be named, and the grant bound; the agent's own
    certificate must name it, and a certificate naming another node stops any agent."""
    strict = {"require_node_certificates": True}
    source = await start_agent(
        "prefill", node_id="src", **tls_settings(certs, "agent-src"), **strict
    )
    async with secure(source.address, files_of(certs, "conductor")) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        handle, token, keys = await staged_and_locked(stub)
        unbound = pb.TxAllocateRequest(
            key_layout=KEY_LAYOUT,
            tx_id="u",
            tenant="t",
            block_keys=keys,
            lease_s=30,
            mode=pb.TX_MODE_LOCK_ONLY,
        )
        unbound_token = (await stub.TxAllocate(unbound)).read_token
    denied = grpc.StatusCode.PERMISSION_DENIED
    read = pb.ReadBlocksRequest(tx_id="l", tenant="t", block_keys=keys, read_token=token)
    async with secure(source.address, files_of(certs, "agent")) as channel:  # not named
        assert await rpc_status(pb_grpc.NodeAgentStub(channel).ReadBlocks(read)) == denied
    async with secure(source.address, files_of(certs, "agent-dst")) as channel:
        dst = pb_grpc.NodeAgentStub(channel)
        loose = pb.ReadBlocksRequest(
            tx_id="u", tenant="t", block_keys=keys, read_token=unbound_token
        )
        assert await rpc_status(dst.ReadBlocks(loose)) == denied  # a grant bound to no node
        assert [c async for c in dst.ReadBlocks(read)]
        fetch = pb.FetchKvRequest(stage_handle=handle, tenant="t")
        assert [c async for c in dst.FetchKv(fetch)]
    async with secure(source.address, files_of(certs, "conductor")) as channel:
        for tx_id in ("l", "u"):
            await pb_grpc.NodeAgentStub(channel).TxAbort(pb.TxAbortRequest(tx_id=tx_id))
    assert_no_locks(source)
    with pytest.raises(ValueError, match="must name its node"):
        await start_agent("prefill", node_id="x", **tls_settings(certs, "agent"), **strict)
    with pytest.raises(ValueError, match="names node 'dst'"):
        await start_agent("prefill", node_id="src", **tls_settings(certs, "agent-dst"))
    with pytest.raises(ValueError, match="needs mTLS"):
        await start_agent("prefill", **strict)


async def test_disaggregated_serving_with_node_certificates(
    start_agent: AgentFactory, conductor: ConductorFactory, certs: Path
) -> None:
    """The conductor binds each hand-off to the decode node it chose: served end to end
    with every agent requiring node certificates."""
    strict = {"require_node_certificates": True}
    prefill = await start_agent(
        "prefill", node_id="src", **tls_settings(certs, "agent-src"), **strict
    )
    decode = await start_agent(
        "decode", node_id="dst", **tls_settings(certs, "agent-dst"), **strict
    )
    async with conductor([prefill, decode], **tls_settings(certs, "conductor")) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body("hello " * 60))
        assert resp.status_code == 200, resp.text
    assert decode.service.metrics.transfer_bytes.labels("received", "handoff")._value.get() > 0
    assert_no_locks(prefill, decode)


async def test_a_conductor_without_tls_cannot_use_tls_agents(
    start_agent: AgentFactory, conductor: ConductorFactory, certs: Path
) -> None:
    agent = await start_agent("both", **tls_settings(certs, "agent"))
    async with conductor([agent]) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 503, resp.text
    assert_no_locks(agent)


async def test_server_picks_up_rotated_files(
    start_agent: AgentFactory, certs: Path, other_ca: Path, tmp_path: Path
) -> None:
    live = tmp_path / "live"
    shutil.copytree(certs, live)
    agent = await start_agent("both", **tls_settings(live, "agent"))
    async with secure(agent.address, files_of(certs, "conductor")) as channel:
        await pb_grpc.NodeAgentStub(channel).GetInfo(pb.GetInfoRequest())
    for name in ("agent.pem", "agent-key.pem", "ca.pem"):  # a new CA and certificate
        shutil.copy(other_ca / name, live / name)
    async with secure(agent.address, files_of(other_ca, "conductor")) as channel:
        await pb_grpc.NodeAgentStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
    async with secure(agent.address, files_of(certs, "conductor")) as channel:
        call = pb_grpc.NodeAgentStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
        assert await rpc_status(call) == grpc.StatusCode.UNAVAILABLE  # the old CA is out


async def test_token_stream_listener_picks_up_rotated_files(
    certs: Path, other_ca: Path, tmp_path: Path
) -> None:
    """The token stream's TLS (a plain socket, not gRPC) follows the files as gRPC does:
    after they change, the next handshake uses the new CA and certificate."""
    live = tmp_path / "live"
    shutil.copytree(certs, live)

    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(
        answer, "127.0.0.1", 0, ssl=files_of(live, "agent").server_ssl_context()
    )
    port = server.sockets[0].getsockname()[1]

    async def hello(bundle: Path) -> bytes:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=files_of(bundle, "conductor").client_ssl_context(),
            server_hostname=AGENT_NAME,
        )  # fmt: skip
        try:
            return await asyncio.wait_for(reader.read(2), 5)
        finally:
            writer.close()

    try:
        assert await hello(certs) == b"ok"
        for name in ("agent.pem", "agent-key.pem", "ca.pem"):  # a new CA and certificate
            shutil.copy(other_ca / name, live / name)
        assert await hello(other_ca) == b"ok"
        with pytest.raises(ssl.SSLCertVerificationError):  # the agent's old CA is out
            await hello(certs)
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("host", "policy", "refused"),
    [
        ("127.0.0.1", "loopback", False),
        ("0.0.0.0", "loopback", True),  # every interface: reachable from the network
        ("0.0.0.0", "any", False),  # behind a mesh that encrypts
        ("127.0.0.1", "never", True),
    ],
)
async def test_plaintext_only_where_the_policy_allows(
    host: str, policy: PlaintextPolicy, refused: bool
) -> None:
    from node_agent.main import build_engine

    settings = AgentSettings(port=0, host=host, grpc_plaintext=policy, calibrate=False)
    server = AgentServer(settings, build_engine(settings))
    if refused:
        with pytest.raises(ValueError, match="refusing plaintext gRPC"):
            await server.start()
        await server.engine.aclose()
        return
    await server.start()
    await server.stop(grace_s=0.1)


async def test_kvc_probe_checks_a_tls_agent_with_its_own_files(
    tls_agent: AgentServer, certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from kvc_cli.probe import probe

    address = tls_agent.address
    with pytest.raises(ValueError, match="grpcs:// needs"):
        await asyncio.to_thread(probe, f"grpcs://{address}")
    for name, value in tls_settings(certs, "agent").items():
        monkeypatch.setenv(f"KVC_AGENT_{name.upper()}", value)
    assert await asyncio.to_thread(probe, f"grpcs://{address}")
    assert not await asyncio.to_thread(probe, f"grpc://{address}", 2.0)  # plaintext: refused
