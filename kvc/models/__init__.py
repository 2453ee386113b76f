"""Model folders shipped inside the package.

``tiny-llama`` is a 2-layer Llama with a byte-level BPE tokenizer trained on
``corpus.txt``. It has no weights file: ``kvc_init.json`` tells the embedded
engine to build random weights from a fixed seed, so every process (and every
machine) gets bit-identical weights without anything being downloaded. The
same folder can be handed to vLLM with ``--load-format dummy``.
``build_tiny_llama`` regenerates every file from the corpus; a test checks the
shipped files are not stale.
"""

from pathlib import Path

MODELS_DIR: Path = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR: Path = MODELS_DIR / "tiny-llama"
CORPUS_PATH: Path = MODELS_DIR / "corpus.txt"

__all__ = ["CORPUS_PATH", "DEFAULT_MODEL_DIR", "MODELS_DIR"]
