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
and ``KvCache.concat``. ``KvCache.to_bytes``/``from_bytes`` give the wire
format for KV transfer (layer-major, key then value, native little-endian
dtype). The node agent calls all of this from one worker thread.

Model folders with ``kvc_init.json`` have no weights: random weights are built
from the recorded seed, bit-identical in every process.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kvc.sampling import Sampling
from node_agent.kv import KvContent, KvLayout

__all__ = [
    "EmbeddedModel",
    "KvCache",
    "Sampler",
    "TensorKvCodec",
]

_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_INIT_MARKER: Final = "kvc_init.json"


def _dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in _DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


class KvCache:
    """Per-layer (key, value) tensors of a token range, each ``[1, kv_heads, seq, head_dim]``.

    Treated as immutable: no method writes into the tensors, and ``slice``
    returns compact copies so a pooled block never pins (or aliases) the
    storage of the larger cache it was cut from.
    """

    __slots__ = ("_layers",)

    def __init__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not layers:
            raise ValueError("a KV cache needs at least one layer")
        first_key = layers[0][0]
        for index, (key, value) in enumerate(layers):
            if key.dim() != 4 or key.shape != value.shape:
                raise ValueError(
                    f"layer {index}: key {tuple(key.shape)} and value {tuple(value.shape)} "
                    "must both be [1, kv_heads, seq, head_dim]"
                )
            if key.shape != first_key.shape or key.dtype != first_key.dtype:
                raise ValueError(f"layer {index} differs in shape or dtype from layer 0")
            if value.dtype != key.dtype:
                raise ValueError(f"layer {index}: key and value dtypes differ")
        if first_key.shape[0] != 1:
            raise ValueError(f"batch size must be 1, got {first_key.shape[0]}")
        self._layers: tuple[tuple[torch.Tensor, torch.Tensor], ...] = tuple(
            (key, value) for key, value in layers
        )

    @property
    def layers(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return self._layers

    @property
    def num_tokens(self) -> int:
        return int(self._layers[0][0].shape[2])

    @property
    def layout(self) -> KvLayout:
        key = self._layers[0][0]
        return KvLayout(
            num_layers=len(self._layers),
            num_kv_heads=int(key.shape[1]),
            head_dim=int(key.shape[3]),
            dtype=_dtype_name(key.dtype),
        )

    @property
    def device(self) -> torch.device:
        return self._layers[0][0].device

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.layout.bytes_per_token

    def __repr__(self) -> str:
        return f"KvCache(num_tokens={self.num_tokens}, layout={self.layout}, device={self.device})"

    def slice(self, start: int, end: int) -> KvCache:
        """Tokens ``[start, end)`` as a compact copy."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"slice [{start}, {end}) outside [0, {self.num_tokens}]")
        return KvCache(
            [
                (key[:, :, start:end, :].clone(), value[:, :, start:end, :].clone())
                for key, value in self._layers
            ]
        )

    @staticmethod
    def concat(parts: Sequence[KvCache]) -> KvCache:
        """Join consecutive token ranges into one cache (always a fresh copy)."""
        if not parts:
            raise ValueError("concat needs at least one part")
        layout = parts[0].layout
        device = parts[0].device
        for index, part in enumerate(parts[1:], start=1):
            if part.layout != layout:
                raise ValueError(f"part {index} has layout {part.layout}, expected {layout}")
            if part.device != device:
                raise ValueError(f"part {index} is on {part.device}, expected {device}")
        return KvCache(
            [
                (
                    torch.cat([part._layers[i][0] for part in parts], dim=2),
                    torch.cat([part._layers[i][1] for part in parts], dim=2),
                )
                for i in range(layout.num_layers)
            ]
        )

    def to(self, device: str | torch.device) -> KvCache:
        """This cache on ``device`` (``self`` when already there)."""
        target = torch.device(device)
        if self.device == target:
            return self
        return KvCache([(key.to(target), value.to(target)) for key, value in self._layers])

    def to_bytes(self) -> bytes:
        """Layer-major, key then value, each ``[kv_heads, seq, head_dim]`` C-order, native dtype."""
        if self.num_tokens == 0:
            return b""
        flat = [t.reshape(-1) for pair in self._layers for t in pair]
        joined = torch.cat(flat).cpu()
        return bytes(joined.view(torch.uint8).numpy().tobytes())

    @staticmethod
    def from_bytes(
        layout: KvLayout,
        data: bytes | bytearray | memoryview,
        num_tokens: int,
        device: str | torch.device | None = None,
    ) -> KvCache:
        """Rebuild a cache written by ``to_bytes``; ``device`` None means CPU."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        expected = layout.bytes_per_token * num_tokens
        size = len(memoryview(data).cast("B"))
        if size != expected:
            raise ValueError(
                f"KV payload has {size} bytes but {num_tokens} tokens of layout "
                f"{layout} need {expected} ({layout.bytes_per_token} bytes per token)"
            )
        target = torch.device(device if device is not None else "cpu")
        shape = (1, layout.num_kv_heads, num_tokens, layout.head_dim)
        if num_tokens == 0:
            empty = torch.empty(shape, dtype=_DTYPES[layout.dtype], device=target)
            return KvCache([(empty, empty.clone()) for _ in range(layout.num_layers)])
        # bytearray: a private, writable copy (torch warns on read-only buffers).
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(_DTYPES[layout.dtype])
        per_tensor = layout.num_kv_heads * num_tokens * layout.head_dim
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(layout.num_layers):
            base = 2 * layer * per_tensor
            key = flat[base : base + per_tensor].view(shape)
            value = flat[base + per_tensor : base + 2 * per_tensor].view(shape)
            layers.append((key.to(target), value.to(target)))
        return KvCache(layers)

    def to_dynamic_cache(self, config: Any = None) -> DynamicCache:
        """A transformers ``DynamicCache`` holding a copy of this KV.

        ``DynamicLayer.update`` concatenates into new tensors, so running a
        model on the result never writes into this cache's tensors.
        """
        pairs = [(key, value) for key, value in self._layers]
        return DynamicCache(ddp_cache_data=pairs, config=config)

    @staticmethod
    def from_model_cache(cache: Any) -> KvCache:
        """Wrap a model's cache (``DynamicCache`` or legacy tuple of (k, v))."""
        layers = getattr(cache, "layers", None)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if layers is not None:
            for index, layer in enumerate(layers):
                key, value = getattr(layer, "keys", None), getattr(layer, "values", None)
                if key is None or value is None:
                    raise ValueError(f"cache layer {index} holds no KV")
                pairs.append((key, value))
        else:
            pairs.extend((entry[0], entry[1]) for entry in cache)
        return KvCache(pairs)


class TensorKvCodec:
    """The ``KvCodec`` of the embedded engine: tensors on the engine's ``device``."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)

    def concat(self, parts: Sequence[KvContent]) -> KvCache:
        return KvCache.concat([tensor_kv(part) for part in parts])

    def from_bytes(
        self, layout: KvLayout, data: bytes | bytearray | memoryview, num_tokens: int
    ) -> KvCache:
        return KvCache.from_bytes(layout, data, num_tokens, self.device)


def tensor_kv(content: KvContent) -> KvCache:
    """``content`` as the tensors it is; content of another engine is a programming error."""
    if not isinstance(content, KvCache):
        raise TypeError(f"the embedded engine cannot use {type(content).__name__} as KV")
    return content


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
            dtype=_dtype_name(next(model.parameters()).dtype),
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
            torch_dtype = _DTYPES[dtype]
        else:
            configured = getattr(config.get_text_config(), "dtype", None) or getattr(
                config, "dtype", None
            )
            if isinstance(configured, str):
                configured = _DTYPES.get(configured)
            torch_dtype = configured if configured in _DTYPES.values() else torch.float32
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
            # Build on CPU under a private RNG state: identical weights in
            # every process, and the caller's global RNG is left untouched.
            with torch.random.fork_rng(devices=[]):
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


class Sampler:
    """Picks the next token from logits; one per request (it owns the RNG)."""

    def __init__(self, params: Sampling) -> None:
        if not params.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        self.params = params
        self._generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        else:
            self._generator.seed()

    def sample(self, logits: torch.Tensor) -> int:
        """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling."""
        scores = logits.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        if self.params.temperature == 0.0:
            return int(torch.argmax(scores).item())
        probs = torch.softmax(scores / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            drop = (cumulative - sorted_probs) >= self.params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=self._generator)
            return int(order[choice].item())
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
