"""gRPC's fork handlers are off in our processes (``kvc/__init__.py``): with them on, a
process using gRPC that starts a program forks a child in which gRPC restarts its poller,
and the child can abort before ``exec`` (grpc/grpc#43055). Each case runs in a fresh
interpreter, since gRPC reads the switch once, when it is first imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# A gRPC call in flight (the poller busy), then ten programs started as
# kvc_cli.supervisor starts them (a preexec_fn: a real fork, fork handlers and all).
SCRIPT = textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "kvc":
        import kvc  # noqa: F401
    import asyncio
    import subprocess
    import grpc
    from kvc.processes import die_with_parent

    async def main() -> None:
        channel = grpc.aio.insecure_channel("127.0.0.1:1")
        call = asyncio.ensure_future(channel.unary_unary("/x/y")(b"", wait_for_ready=True))
        # The call is in flight once the channel has left IDLE (connecting to nothing).
        state = channel.get_state(try_to_connect=True)
        while state is grpc.ChannelConnectivity.IDLE:
            await asyncio.wait_for(channel.wait_for_state_change(state), timeout=30)
            state = channel.get_state()
        for _ in range(10):
            child = subprocess.Popen(
                ["/bin/true"], preexec_fn=die_with_parent, start_new_session=True
            )
            assert child.wait() == 0
        call.cancel()
        await channel.close()

    asyncio.run(main())
    """
)


def _run(first: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, first],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_importing_kvc_first_keeps_grpc_out_of_forked_children() -> None:
    assert "fork_posix" not in _run("kvc")


def test_without_it_grpc_runs_its_fork_handlers() -> None:
    """The observation above can fail: gRPC alone logs its fork handlers at each fork
    made while a call is in flight."""
    assert "fork() handlers" in _run("grpc")
