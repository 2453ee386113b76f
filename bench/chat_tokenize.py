"""Tokenizing a growing conversation: what the conductor pays per request as a chat is
sent again with one more turn each time (an agent's tool loop, a long chat).

  python -m bench.chat_tokenize [--turns 1 10 40 100] [--words 300] [--repeats 5]
      [--out bench/results]

For each conversation length, the conversation's requests are replayed from its first
turn (so the piece cache holds what a conductor would hold: the earlier requests of
this conversation), and the last request is timed, ``--repeats`` times: once with the
piece cache (``ChatTokenizer.chat_token_ids`` as the conductor calls it) and once
encoding the whole rendered text (``piece_cache_tokens=0``). Turns alternate user and
assistant, ``--words`` words of the shipped corpus each (unique per turn). Both ways
give the same ids (checked every time). Writes ``chat_tokenize.md``/``.json`` and a PNG.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from bench.report import markdown_table, summarize_ms, write_results
from kvc.models import CORPUS_PATH, DEFAULT_MODEL_DIR
from kvc.tokenization import ChatTokenizer

TURNS = (1, 10, 40, 100)


def conversation(turns: int, words: int, seed: int) -> list[dict[str, str]]:
    vocab = CORPUS_PATH.read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"turn {i}: " + " ".join(rng.choice(vocab) for _ in range(words)),
        }
        for i in range(turns)
    ]


def measure(turns: int, words: int, repeats: int) -> dict[str, Any]:
    whole_s: list[float] = []
    pieces_s: list[float] = []
    tokens = 0
    for r in range(repeats):
        messages = conversation(turns, words, seed=turns * 1000 + r)
        cached = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
        warm = [{"role": "user", "content": "warm up"}]  # template compiled, cache set up
        cached.chat_token_ids(warm, cache_scope="warm-up")
        for n in range(1, turns):  # the conversation's earlier requests
            cached.chat_token_ids(messages[:n], cache_scope="bench")
        started = time.perf_counter()
        got = cached.chat_token_ids(messages, cache_scope="bench")
        pieces_s.append(time.perf_counter() - started)
        whole = ChatTokenizer(
            cached.tokenizer,
            chat_templates={"default": cached.chat_template_source},
            bos_token=cached.bos_token,
            eos_token=cached.eos_token,
            piece_cache_tokens=0,
        )
        whole.chat_token_ids(warm)
        started = time.perf_counter()
        want = whole.chat_token_ids(messages)
        whole_s.append(time.perf_counter() - started)
        if got != want:
            raise AssertionError(f"{turns} turns: the piece cache changed the token ids")
        tokens = len(got)
    whole_ms, pieces_ms = summarize_ms(whole_s), summarize_ms(pieces_s)
    return {
        "turns": turns,
        "prompt_tokens": tokens,
        "whole_p50_ms": whole_ms["p50_ms"],
        "pieces_p50_ms": pieces_ms["p50_ms"],
        "speedup": whole_ms["p50_ms"] / pieces_ms["p50_ms"],
    }


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["prompt_tokens"] for r in rows]
    ax.plot(x, [r["whole_p50_ms"] for r in rows], marker="o", label="whole text")
    ax.plot(x, [r["pieces_p50_ms"] for r in rows], marker="o", label="piece cache")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (conversation sent again with one more turn)")
    ax.set_ylabel("tokenization p50 (ms)")
    ax.set_title("Conductor tokenization per request")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--turns", type=int, nargs="*", default=list(TURNS))
    parser.add_argument("--words", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args(argv)
    if min(ns.turns, default=0) < 1 or ns.words < 1 or ns.repeats < 1:
        parser.error("--turns, --words and --repeats must be >= 1")
    rows = [measure(t, ns.words, ns.repeats) for t in ns.turns]
    table = markdown_table(
        ["turns", "prompt tokens", "whole text p50 ms", "piece cache p50 ms", "ratio"],
        [
            [r["turns"], r["prompt_tokens"], r["whole_p50_ms"], r["pieces_p50_ms"], r["speedup"]]
            for r in rows
        ],
    )
    md = write_results(
        ns.out,
        "chat_tokenize",
        "Tokenizing a conversation sent again with one more turn",
        f"{ns.words}-word turns, {ns.repeats} conversations per row, the demo model's "
        f"tokenizer and template.\n\n{table}",
        {"rows": rows},
    )
    plot(ns.out / "chat_tokenize.png", rows)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
