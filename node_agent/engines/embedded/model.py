"""The embedded engine: a real transformer run in-process with torch + transformers.

It exists so the whole control plane (prefix-cache routing, KV block pools,
prefill/decode disaggregation, KV transfer between nodes) can be exercised for
real on machines without a GPU: every forward produces genuine attention
keys/values, and reusing a cached prefix must give the same logits as a full
recompute, which makes cache bugs visible as wrong tokens.

The API is synchronous and stateless per call: ``EmbeddedModel.forward`` takes
token ids plus an optional ``KvCache`` of what came before and returns the
last-position logits and the full updated cache, never mutating its input, so
callers can keep prefix blocks in a pool and combine them with ``KvCache.slice``
and ``KvCache.concat`` (``kv_tensors``). ``KvCache.to_bytes``/``from_bytes`` give the wire
format for KV transfer (layer-major, key then value, native little-endian
dtype). The node agent calls all of this from one worker thread.

Model folders with ``kvc_init.json`` have no weights: random weights are built
from the recorded seed, bit-identical in every process on the same kind of device
(drawn on the GPU for a CUDA agent, on the CPU otherwise).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from node_agent.engines.embedded.kv_tensors import TORCH_DTYPES, KvCache, dtype_name
from node_agent.kv import KvLayout

__all__ = ["EmbeddedModel"]

_INIT_MARKER: Final = "kvc_init.json"


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class EmbeddedModel:
    """A causal LM in eval mode with a stateless, cache-in/cache-out forward."""

    def __init__(self, model: Any, *, name: str, device: torch.device) -> None:
        self._model = model
        self._config = model.config
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns).
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        text_config = self._config.get_text_config()
        self._device = device
        self.name: str = name
        self.device: str = str(device)
        num_heads = int(text_config.num_attention_heads)
        kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text_config, "head_dim", None) or (
            int(text_config.hidden_size) // num_heads
        )
        self.layout: KvLayout = KvLayout(
            num_layers=int(text_config.num_hidden_layers),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            dtype=dtype_name(next(model.parameters()).dtype),
        )
        self.max_model_len: int = int(text_config.max_position_embeddings)
        self.vocab_size: int = int(text_config.vocab_size)

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        device: str = "auto",
        threads: int | None = None,
        dtype: str | None = None,
    ) -> EmbeddedModel:
        """Load a Hugging Face folder (never touching the network).

        ``device="auto"`` picks CUDA when available. ``threads`` sets torch's
        intra-op thread count (process-wide). ``dtype`` overrides the folder's
        dtype; by default it is kept, except float16 on CPU becomes float32.
        A folder with ``kvc_init.json`` gets seeded random weights instead of
        loading a weights file.
        """
        model_dir = Path(model_dir)
        if threads is not None:
            torch.set_num_threads(threads)
        target = _resolve_device(device)
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        if dtype is not None:
            torch_dtype = TORCH_DTYPES[dtype]
        else:
            configured = getattr(config.get_text_config(), "dtype", None) or getattr(
                config, "dtype", None
            )
            if isinstance(configured, str):
                configured = TORCH_DTYPES.get(configured)
            torch_dtype = configured if configured in TORCH_DTYPES.values() else torch.float32
            if torch_dtype == torch.float16 and target.type == "cpu":
                torch_dtype = torch.float32

        marker = model_dir / _INIT_MARKER
        if marker.is_file():
            init = json.loads(marker.read_text(encoding="utf-8"))
            seed = int(init["seed"])
            init_range = float(init.get("initializer_range", config.initializer_range))
            config.initializer_range = init_range
            text_config = config.get_text_config()
            if text_config is not config:
                text_config.initializer_range = init_range
            # Under a private RNG state (the caller's global RNG is left untouched):
            # identical weights in every process on the same kind of device. On a GPU
            # they are drawn there: CPU's normal_ is single-threaded (~2.5 minutes for
            # an 8B shape; seconds on the GPU), and CUDA's generator draws other
            # numbers than the CPU's, so a CPU and a GPU agent of one seed differ.
            if target.type == "cuda":
                index = target.index if target.index is not None else torch.cuda.current_device()
                rng = torch.random.fork_rng(devices=[index])
            else:
                rng = torch.random.fork_rng(devices=[])
            with rng, torch.device(target if target.type == "cuda" else "cpu"):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), local_files_only=True, dtype=torch_dtype
            )
        model = model.to(target)
        model.eval()
        return cls(model, name=model_dir.name, device=target)

    @property
    def model(self) -> Any:
        """The underlying ``transformers`` model."""
        return self._model

    def forward(
        self, token_ids: Sequence[int], past: KvCache | None = None
    ) -> tuple[torch.Tensor, KvCache]:
        """Run ``token_ids`` after ``past``; return last-position logits and past + new KV.

        Logits are a 1-D float32 CPU tensor of size ``vocab_size``. ``past`` is
        not modified.
        """
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("forward needs at least one token id")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        past_len = past.num_tokens if past is not None else 0
        if past_len + len(ids) > self.max_model_len:
            raise ValueError(
                f"{past_len} cached + {len(ids)} new tokens exceed the model's "
                f"context length of {self.max_model_len}"
            )
        if past is not None and past.layout != self.layout:
            raise ValueError(f"past KV layout {past.layout} does not match model {self.layout}")
        with torch.inference_mode():
            input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
            position_ids = torch.arange(
                past_len, past_len + len(ids), dtype=torch.long, device=self._device
            ).unsqueeze(0)
            if past is not None and past_len > 0:
                cache = past.to(self._device).to_dynamic_cache(self._config)
            else:
                cache = DynamicCache(config=self._config)
            output = self._model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
            logits = output.logits[0, -1].to(device="cpu", dtype=torch.float32)
            # The model extends ``cache`` in place (the output's field is named
            # ``past_key_values`` before transformers 5.24 and ``cache`` from then on).
            updated = KvCache.from_model_cache(cache)
        return logits, updated
