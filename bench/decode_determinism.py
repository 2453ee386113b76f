"""Is a P/D handoff exact, and is greedy decoding deterministic on this device?

  python -m bench.decode_determinism [--device cpu|cuda] [--model DIR | --shape llama-8b]
      [--tokens 2048,8192] [--steps 32] [--out bench/results]

A correctness check behind ``bench.pd_ttft``'s "same output" column, on the embedded
engine's own model code, for each prompt length N (a fresh random prompt):

1. the KV of ``prompt[:-1]`` computed (the prefill both deployments run), then ``--steps``
   greedy tokens from it (the reference);
2. the same decode again from the same KV (run-to-run determinism of the decode);
3. the prefill computed again: are the two KVs bit-equal, and the tokens from it;
4. the KV through the handoff's byte round trip (``to_bytes`` / ``KvCache.from_bytes``
   onto the device): bit-equal to the original, first-step logits' largest difference,
   tokens from it;
5. a second process builds the model from the same seed, prefills, decodes: are its
   weights the same (per-tensor checksums of the bits) and its tokens.

Token columns count the steps (of ``--steps``) equal to the reference. Writes
``decode_determinism-<model>-<device>.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.kv_tiers import block_token_counts
from bench.report import markdown_table, write_results
from bench.tier_ttft import add_model_args, device_name, model_folder
from node_agent.engines.embedded.kv_tensors import KvCache
from node_agent.engines.embedded.model import EmbeddedModel


def greedy(model: EmbeddedModel, past: KvCache, last: int, steps: int) -> tuple[list[int], Any]:
    """``steps`` greedy tokens after ``past``, and the first step's logits."""
    logits, kv = model.forward((last,), past)
    first = logits.clone()
    tokens: list[int] = []
    for _ in range(steps):
        token = int(torch.argmax(logits))
        tokens.append(token)
        logits, kv = model.forward((token,), kv)
    return tokens, first


def weight_checksums(model: EmbeddedModel) -> list[int]:
    """Per tensor, a position-weighted sum of its bits (as 16- or 32-bit integers, in
    int64 arithmetic): equal for equal tensors; a differing element changes it (bar an
    exact cancellation)."""
    out: list[int] = []
    with torch.no_grad():
        for _, p in sorted(model.model.named_parameters()):
            flat = p.detach().reshape(-1)
            bits = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32)
            weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
            out.append(int((bits.to(torch.int64) * (weights * 2654435761 % 2147483647)).sum()))
    return out


def prefill(model_dir: Path, device: str, n: int) -> tuple[EmbeddedModel, list[int], KvCache]:
    model = EmbeddedModel.load(model_dir, device=device)
    vocab = int(model.model.config.get_text_config().vocab_size)
    rng = random.Random(n)
    prompt = [rng.randrange(10, vocab) for _ in range(n)]
    _, past = model.forward(tuple(prompt[:-1]), None)
    return model, prompt, past


def other_process(model_dir: Path, device: str, n: int, steps: int) -> dict[str, Any]:
    """Steps 5's child: its weight sums and tokens."""
    model, prompt, past = prefill(model_dir, device, n)
    tokens, _ = greedy(model, past, prompt[-1], steps)
    return {"sums": weight_checksums(model), "tokens": tokens}


def check(model_dir: Path, device: str, n: int, steps: int) -> dict[str, Any]:
    model, prompt, past = prefill(model_dir, device, n)
    sums = weight_checksums(model)
    reference, first = greedy(model, past, prompt[-1], steps)
    rerun, _ = greedy(model, past, prompt[-1], steps)
    _, again = model.forward(tuple(prompt[:-1]), None)
    recomputed, _ = greedy(model, again, prompt[-1], steps)
    same_prefill = all(
        torch.equal(a, b) and torch.equal(c, d)
        for (a, c), (b, d) in zip(past.layers, again.layers, strict=True)
    )
    moved = KvCache.from_bytes(past.layout, bytearray(past.to_bytes()), past.num_tokens, device)
    after_move, first_moved = greedy(model, moved, prompt[-1], steps)
    exact_move = all(
        torch.equal(a, b) and torch.equal(c, d)
        for (a, c), (b, d) in zip(past.layers, moved.layers, strict=True)
    )
    del model, past, again, moved
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    child = subprocess.run(
        [sys.executable, "-m", "bench.decode_determinism", "--child", str(model_dir),
         "--device", device, "--tokens", str(n), "--steps", str(steps)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    theirs = json.loads(child.stdout.strip().splitlines()[-1])

    def agree(tokens: list[int]) -> int:
        return sum(a == b for a, b in zip(reference, tokens, strict=False))

    return {
        "tokens": n,
        "steps": steps,
        "rerun_same_kv": agree(rerun),
        "prefill_bit_equal": same_prefill,
        "from_recomputed_kv": agree(recomputed),
        "handoff_bit_equal": exact_move,
        "first_logits_max_diff": float((first - first_moved).abs().max()),
        "after_handoff": agree(after_move),
        "weights_equal_across_processes": theirs["sums"] == sums,
        "other_process": agree(theirs["tokens"]),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    which = add_model_args(parser)
    which.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=block_token_counts, default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    ns = parser.parse_args(args)
    if ns.child is not None:
        print(json.dumps(other_process(ns.child, ns.device, ns.tokens[0], ns.steps)))
        return 0
    command = "python -m bench.decode_determinism" + ("" if not args else " " + shlex.join(args))
    with tempfile.TemporaryDirectory(prefix="determinism-") as tmp:
        model_dir = model_folder(ns, Path(tmp))
        results = [check(model_dir, ns.device, n, ns.steps) for n in ns.tokens]
        model = model_dir.name
    device = device_name(ns.device)
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"Command: `{command}`\n\n- Device: {device}; model {model}; {date}\n\n"
        f"Token columns: steps (of {ns.steps}) equal to the reference decode.\n\n"
    )
    rows = [
        [r["tokens"], r["rerun_same_kv"], r["prefill_bit_equal"], r["from_recomputed_kv"],
         r["handoff_bit_equal"], r["first_logits_max_diff"], r["after_handoff"],
         r["weights_equal_across_processes"], r["other_process"]]
        for r in results
    ]  # fmt: skip
    table = header + markdown_table(
        ["prompt tokens", "rerun, same KV", "prefill bit-equal", "recomputed KV",
         "handoff bit-equal", "first logits, max abs diff after handoff", "after handoff",
         "weights equal, 2 processes", "other process"],
        rows,
    )  # fmt: skip
    name = f"decode_determinism-{model}-{ns.device.split(':')[0]}"
    data = {"command": command, "device": device, "date": date, "results": results}
    md = write_results(ns.out, name, f"Decode determinism: {model} on {device}", table, data)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
