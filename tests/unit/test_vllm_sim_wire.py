"""The simulated engine's KV events are byte-identical to vLLM 0.32's, and the agent's
decoder (node_agent.engines.vllm.events) turns them into the conductor's block keys.

``VLLM_BATCH`` was produced by vLLM 0.32's own classes and encoder in ``.venv-vllm``::

    enc = msgspec.msgpack.Encoder()
    enc.encode(KVEventBatch(ts=1700000000.25, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[2**63 + 5, 7], parent_block_hash=None,
                    token_ids=[1, 2, 3, 4], block_size=2, lora_id=None, medium="GPU",
                    lora_name=None, extra_keys=[("tenant-a",), None], group_idx=0),
        BlockStored(block_hashes=[9], parent_block_hash=7, token_ids=[5, 6], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None, extra_keys=None,
                    group_idx=0),
        BlockRemoved(block_hashes=[2**63 + 5], medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ]))
"""

from __future__ import annotations

from kvc.block_keys import compute_block_keys
from kvc_sim.vllm_sim.cache import KvBlockPool
from kvc_sim.vllm_sim.events import AllBlocksCleared, BlockRemoved, BlockStored, KvCacheEvent
from kvc_sim.vllm_sim.hashing import hash_blocks
from kvc_sim.vllm_sim.kv_events import encode_batch
from node_agent.engines.base import CacheCleared, CacheRemoved, CacheStored
from node_agent.engines.vllm.events import KvEventDecoder

VLLM_BATCH = bytes.fromhex(
    "93cb41d954fc40100000948aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392"
    "cf800000000000000507b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394010203"
    "04aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65"
    "c0aa65787472615f6b6579739291a874656e616e742d61c0a967726f75705f6964780089a474797065ab42"
    "6c6f636b53746f726564ac626c6f636b5f6861736865739109b1706172656e745f626c6f636b5f68617368"
    "07a9746f6b656e5f696473920506aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3"
    "475055a96c6f72615f6e616d65c0a967726f75705f6964780084a474797065ac426c6f636b52656d6f7665"
    "64ac626c6f636b5f68617368657391cf8000000000000005a66d656469756da3475055a967726f75705f69"
    "64780081a474797065b0416c6c426c6f636b73436c656172656400"
)


def test_encoding_is_byte_identical_to_vllms() -> None:
    events: list[KvCacheEvent] = [
        BlockStored((2**63 + 5, 7), None, (1, 2, 3, 4), 2, (("tenant-a",), None)),
        BlockStored((9,), 7, (5, 6), 2, None),
        BlockRemoved((2**63 + 5,)),
        AllBlocksCleared(),
    ]
    assert encode_batch(1700000000.25, events) == VLLM_BATCH


def test_the_agents_decoder_reads_the_simulated_engines_events() -> None:
    pool = KvBlockPool(9, 4)
    tokens = list(range(40, 52))
    hashes = hash_blocks(tokens, 4, "tenant-a")
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, hashes, tokens, start=0, end=2, cache_salt="tenant-a")
    pool.cache_blocks(blocks, hashes, tokens, start=2, end=3, cache_salt="tenant-a")
    pool.free(blocks)
    pool.allocate(8)  # evicts all three
    decoder = KvEventDecoder(model="m", block_size=4, tenant_of_salt=lambda s: s)
    out = decoder.decode(encode_batch(1.0, pool.take_events()))
    keys = compute_block_keys(tokens, tenant="tenant-a", model="m", block_size=4)
    assert out[0] == CacheStored(tuple(keys[:2]), None)
    assert out[1] == CacheStored(tuple(keys[2:]), keys[1])
    removed = [e for e in out[2:] if isinstance(e, CacheRemoved)]
    assert sorted(k for e in removed for k in e.keys) == sorted(keys)
    assert decoder.skipped_blocks == 0
    assert decoder.decode(encode_batch(2.0, [AllBlocksCleared()])) == [CacheCleared()]
