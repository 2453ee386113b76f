"""The embedded engine's KV content: per-layer torch tensors (``KvCache``), and the codec
(``TensorKvCodec``) the agent builds that content with from peers' bytes.

``KvCache.to_bytes``/``from_bytes`` are the wire format for KV transfer (layer-major,
key then value, native little-endian dtype); ``slice`` and ``concat`` cut and join token
ranges, so pool blocks are compact copies that never alias a larger cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final

import torch
from transformers import DynamicCache

from node_agent.kv import KvContent, KvLayout

__all__ = ["TORCH_DTYPES", "KvCache", "TensorKvCodec", "dtype_name", "tensor_kv"]

TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


class KvCache:
    """Per-layer (key, value) tensors of a token range, each ``[1, kv_heads, seq, head_dim]``.

    Treated as immutable: no method writes into the tensors, and ``slice``
    returns compact copies so a pooled block never pins (or aliases) the
    storage of the larger cache it was cut from.
    """

    __slots__ = ("_flat", "_layers")

    def __init__(
        self,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        flat: torch.Tensor | None = None,
    ) -> None:
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
        # One contiguous uint8 buffer every tensor above is a view of (wire layout), when
        # the cache was built from one (``from_flat``): moved between devices in one copy.
        self._flat = flat

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
            dtype=dtype_name(key.dtype),
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

    def flat_bytes(self) -> torch.Tensor:
        """The wire format as one contiguous uint8 tensor on this cache's device (no copy
        when the cache was built from one)."""
        if self._flat is not None:
            return self._flat
        return torch.cat([t.reshape(-1) for pair in self._layers for t in pair]).view(torch.uint8)

    def to_bytes(self) -> bytes:
        """Layer-major, key then value, each ``[kv_heads, seq, head_dim]`` C-order, native dtype."""
        if self.num_tokens == 0:
            return b""
        data: bytes = self.flat_bytes().cpu().numpy().tobytes()
        return data

    def to_buffers(self) -> Iterator[memoryview]:
        """``to_bytes`` as consecutive host buffers, one per tensor (or the one flat
        buffer this cache was built from): views of CPU tensors, one device-to-host copy
        each otherwise. Measured on the CPU machine for 256 MiB of an 8B-wide layout:
        ``to_bytes`` 400-440 ms (a concatenation and a copy into ``bytes``, both into
        fresh pages) against none here."""
        if self.num_tokens == 0:
            return
        parts = [self._flat] if self._flat is not None else [t for p in self._layers for t in p]
        for tensor in parts:
            host = tensor.contiguous().cpu()
            yield memoryview(host.reshape(-1).view(torch.uint8).numpy())

    @staticmethod
    def from_flat(flat: torch.Tensor, layout: KvLayout, num_tokens: int) -> KvCache:
        """Views of ``flat`` (uint8, the wire layout of ``num_tokens`` tokens), no copy."""
        if num_tokens <= 0 or flat.numel() != layout.bytes_per_token * num_tokens:
            raise ValueError(
                f"a flat KV buffer of {flat.numel()} bytes does not hold {num_tokens} tokens "
                f"of {layout}"
            )
        # All 2 x layers views in one call (unbind): building them one slice at a time
        # cost ~200 us per 32-layer block, more than copying its 4 MiB over PCIe.
        tensors = (
            flat.view(TORCH_DTYPES[layout.dtype])
            .view(2 * layout.num_layers, 1, layout.num_kv_heads, num_tokens, layout.head_dim)
            .unbind(0)
        )
        cache = KvCache.__new__(KvCache)  # views of one buffer: consistent by construction
        cache._layers = tuple(zip(tensors[0::2], tensors[1::2], strict=True))
        cache._flat = flat
        return cache

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
            empty = torch.empty(shape, dtype=TORCH_DTYPES[layout.dtype], device=target)
            return KvCache([(empty, empty.clone()) for _ in range(layout.num_layers)])
        # A bytearray (or a writable view of one) is used in place: the caller hands it
        # over. Anything else is copied into a private, writable one (torch warns on
        # read-only buffers). Then one copy onto the target device, not one per tensor.
        view = memoryview(data)
        buffer = data if not view.readonly and view.contiguous else bytearray(data)
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
        return KvCache.from_flat(flat.to(target), layout, num_tokens)

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
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:  # compare equal to tensors' devices
            target = torch.device("cuda", torch.cuda.current_device())
        self.device = target

    def concat(self, parts: Sequence[KvContent]) -> KvCache:
        return KvCache.concat([tensor_kv(part) for part in parts])

    def from_bytes(
        self, layout: KvLayout, data: bytes | bytearray | memoryview, num_tokens: int
    ) -> KvCache:
        return KvCache.from_bytes(layout, data, num_tokens, self.device)

    def to_host(self, content: KvContent) -> KvCache:
        """The content in host memory: one device-to-host copy into a pinned buffer (so the
        copy back is one DMA transfer), or the same (immutable) tensors when the engine
        runs on the CPU (L1 and L2 are then one memory)."""
        kv = tensor_kv(content)
        if kv.device.type == "cpu":
            return kv
        source = kv.flat_bytes()
        host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(source)
        return KvCache.from_flat(host, kv.layout, kv.num_tokens)

    def to_device(self, content: KvContent) -> KvCache:
        """``content`` on the engine's device: one host-to-device copy of its buffer."""
        return self.to_device_many([content])[0]

    def to_device_many(self, contents: Sequence[KvContent]) -> list[KvCache]:
        """Each of ``contents`` on the engine's device, in order: one copy per block
        (each block stays its own compact buffer), all queued without waiting (from
        pinned host memory, asynchronous DMA back to back), then one wait for them all."""
        out: list[KvCache] = []
        queued = False
        for content in contents:
            kv = tensor_kv(content)
            if kv.device == self.device:
                out.append(kv)
                continue
            source = kv.flat_bytes()
            target = torch.empty(source.shape, dtype=torch.uint8, device=self.device)
            target.copy_(source, non_blocking=True)
            queued = True
            out.append(KvCache.from_flat(target, kv.layout, kv.num_tokens))
        if queued and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out


def tensor_kv(content: KvContent) -> KvCache:
    """``content`` as the tensors it is; content of another engine is a programming error."""
    if not isinstance(content, KvCache):
        raise TypeError(f"the embedded engine cannot use {type(content).__name__} as KV")
    return content
