"""cache_salt at the KV cache manager: requests share cached blocks only under the same salt.

The salt is an extra key of a request's first block; the hash chain carries it to every later block.
(Engine- and server-level salt tests live elsewhere.)"""

from __future__ import annotations

import torch

from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec, group_layers
from vllite_core.core.kv_cache_utils import hash_block_tokens, hash_request_tokens
from vllite_core.request import Request
from vllite_core.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks + 1, so all 3 blocks can hit


def req(rid: str, tokens: list[int], salt: str | None = None, extra: tuple = ()) -> Request:
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt, block_extra_keys=extra)


def admit(mgr: KVCacheManager, r: Request) -> int:
    """Look up and allocate the whole prompt as the scheduler does; returns the hit tokens."""
    hit, n = mgr.get_computed_blocks(r)
    assert mgr.allocate_slots(r, r.num_tokens - n, hit, n) is not None
    r.num_computed_tokens = r.num_tokens
    return n


def run(mgr: KVCacheManager, r: Request) -> int:
    """Admit, compute the prompt and finish: its full blocks stay cached."""
    n = admit(mgr, r)
    mgr.free(r)
    mgr.check_integrity([])
    return n


def hit_tokens(mgr: KVCacheManager, r: Request) -> int:
    hit, n = mgr.get_computed_blocks(r)
    assert n == hit.num_blocks * BS
    return n


def test_other_salt_misses_same_salt_hits() -> None:
    mgr = KVCacheManager(32, BS)
    a = req("a", PROMPT, salt="tenant-1")
    assert admit(mgr, a) == 0
    a_ids = a.block_ids()
    mgr.free(a)
    assert hit_tokens(mgr, req("b", PROMPT, salt="tenant-2")) == 0
    same = req("c", PROMPT, salt="tenant-1")
    hit, n = mgr.get_computed_blocks(same)
    assert n == 3 * BS
    assert [blk.block_id for blk in hit.blocks[0]] == a_ids[:3]
    # The hit blocks are the ones a cached under its salted hashes.
    assert [blk.block_hash for blk in hit.blocks[0]] == a.block_hashes[:3] == same.block_hashes[:3]


def test_salted_and_unsalted_never_share() -> None:
    mgr = KVCacheManager(32, BS)
    assert run(mgr, req("plain", PROMPT)) == 0
    assert hit_tokens(mgr, req("salted", PROMPT, salt="s")) == 0
    other = [t + 1000 for t in PROMPT]
    assert run(mgr, req("salted2", other, salt="s")) == 0
    assert hit_tokens(mgr, req("plain2", other)) == 0
    # Each still hits its own kind.
    assert hit_tokens(mgr, req("plain3", PROMPT)) == 3 * BS
    assert hit_tokens(mgr, req("salted3", other, salt="s")) == 3 * BS


def test_salt_enters_the_first_block_only_and_the_chain_carries_it() -> None:
    mgr = KVCacheManager(32, BS)
    salted = req("s", PROMPT, salt="s")
    plain = req("p", PROMPT)
    mgr.get_computed_blocks(salted)
    mgr.get_computed_blocks(plain)
    assert plain.block_hashes == hash_request_tokens(BS, PROMPT)
    first = hash_block_tokens(None, PROMPT[0:4], (("cache_salt", "s"),))
    assert salted.block_hashes[0] == first
    # Later blocks have no salt key of their own: only their parent differs.
    assert salted.block_hashes[1] == hash_block_tokens(first, PROMPT[4:8])
    assert salted.block_hashes[2] == hash_block_tokens(salted.block_hashes[1], PROMPT[8:12])
    assert salted.block_hashes[1:] == hash_request_tokens(BS, PROMPT[4:12], parent_hash=first)
    assert not set(salted.block_hashes) & set(plain.block_hashes)


def test_same_salt_different_suffixes_share_the_common_prefix() -> None:
    mgr = KVCacheManager(32, BS)
    common = PROMPT[:8]
    a = req("a", common + [1, 2, 3, 4, 5], salt="s")
    b = req("b", common + [6, 7, 8, 9, 10], salt="s")
    assert admit(mgr, a) == 0
    assert admit(mgr, b) == 2 * BS  # both common blocks, while a still runs
    assert a.block_ids()[:2] == b.block_ids()[:2]
    assert a.block_ids()[2:] != b.block_ids()[2:]
    assert [blk.ref_cnt for blk in b.kv_blocks[0][:2]] == [2, 2]
    assert a.block_hashes[:2] == b.block_hashes[:2] and a.block_hashes[2] != b.block_hashes[2]
    mgr.check_integrity([a, b])
    # Another salt shares none of it, not even the first block.
    assert hit_tokens(mgr, req("c", common + [1, 2, 3, 4, 5], salt="t")) == 0


def test_extra_keys_still_separate_caches_under_one_salt() -> None:
    mgr = KVCacheManager(32, BS)
    assert run(mgr, req("a", PROMPT, salt="s", extra=("lora", 1))) == 0
    assert hit_tokens(mgr, req("b", PROMPT, salt="s")) == 0
    assert hit_tokens(mgr, req("c", PROMPT, salt="s", extra=("lora", 2))) == 0
    assert hit_tokens(mgr, req("d", PROMPT, extra=("lora", 1))) == 0  # same keys, no salt
    assert hit_tokens(mgr, req("e", PROMPT, salt="t", extra=("lora", 1))) == 0
    assert hit_tokens(mgr, req("f", PROMPT, salt="s", extra=("lora", 1))) == 3 * BS
    # The per-request keys go into every block, the salt into the first only.
    f = req("g", PROMPT, salt="s", extra=("lora", 1))
    mgr.get_computed_blocks(f)
    first = hash_block_tokens(None, PROMPT[0:4], (("cache_salt", "s"), "lora", 1))
    assert f.block_hashes[0] == first
    assert f.block_hashes[1] == hash_block_tokens(first, PROMPT[4:8], ("lora", 1))


def test_decoded_blocks_are_cached_under_the_salted_chain() -> None:
    mgr = KVCacheManager(32, BS)
    a = req("a", PROMPT[:6], salt="s")
    admit(mgr, a)
    for t in (7, 8, 9, 10, 11, 12):  # decode: blocks fill and are hashed on the salted chain
        a.append_output_token_ids(t)
        assert mgr.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    tokens = list(a.all_token_ids)
    mgr.free(a)
    assert hit_tokens(mgr, req("b", tokens + [0], salt="s")) == 3 * BS
    assert hit_tokens(mgr, req("c", tokens + [0], salt="other")) == 0
    assert hit_tokens(mgr, req("d", tokens + [0])) == 0


def test_salt_separates_every_cache_group() -> None:
    dt = torch.float16
    specs = [FullAttentionSpec(BS, 1, 8, dt), SlidingWindowSpec(BS, 1, 8, dt, sliding_window=6)]
    mgr = KVCacheManager(32, BS, groups=group_layers(specs))
    a = req("a", PROMPT, salt="s")
    assert run(mgr, a) == 0
    index = mgr.block_pool.cached_block_hash_to_block
    assert {key for key in index} == {(h, g) for h in a.block_hashes for g in (0, 1)}
    assert hit_tokens(mgr, req("b", PROMPT, salt="t")) == 0
    assert hit_tokens(mgr, req("c", PROMPT)) == 0
    hit, n = mgr.get_computed_blocks(req("d", PROMPT, salt="s"))
    assert n == 3 * BS
    assert [blk.is_null for blk in hit.blocks[1]] == [True, False, False]  # the window starts at 7


def test_salted_misses_are_counted() -> None:
    mgr = KVCacheManager(32, BS)
    run(mgr, req("a", PROMPT, salt="s"))
    run(mgr, req("b", PROMPT, salt="t"))
    run(mgr, req("c", PROMPT, salt="s"))
    s = mgr.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (3, 3 * len(PROMPT), 3 * BS)
