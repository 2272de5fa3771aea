"""Building blocks of the paged KV cache: block hashes, blocks, the free queue, stats.

Pure Python on purpose: this runs on the scheduler's hot path every step, and
must not depend on torch or on any device.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from vllite_core.multimodal.features import mm_block_keys

# A block hash is the sha256 digest of (parent hash, token ids, extra keys).
# It is chained (each block's hash covers its whole prefix), and deterministic
# across processes and runs, unlike Python's salted hash().
BlockHash = bytes

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def _encode_key(key: object, out: list[bytes]) -> None:
    """Append a canonical, type-tagged encoding of one extra key to ``out``.

    Only value types with a stable encoding are accepted, so a hash never
    depends on object identity or on per-process state.
    """
    if key is None:
        out.append(b"N")
    elif isinstance(key, bool):  # before int: bool is an int subclass
        out.append(b"T" if key else b"F")
    elif isinstance(key, int):
        data = str(key).encode()
        out.append(b"i" + struct.pack("<I", len(data)) + data)
    elif isinstance(key, str):
        data = key.encode("utf-8")
        out.append(b"s" + struct.pack("<I", len(data)) + data)
    elif isinstance(key, (bytes, bytearray)):
        out.append(b"b" + struct.pack("<I", len(key)) + bytes(key))
    elif isinstance(key, float):
        out.append(b"f" + struct.pack("<d", key))
    elif isinstance(key, (tuple, list)):
        out.append(b"(" + struct.pack("<I", len(key)))
        for item in key:
            _encode_key(item, out)
    else:
        raise TypeError(
            f"block extra key of type {type(key).__name__} has no stable hash encoding; "
            "use None, bool, int, str, bytes, float or tuples of them"
        )


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple = (),
) -> BlockHash:
    """Hash one full block, chained to its parent so equal hashes mean equal prefixes."""
    h = hashlib.sha256()
    if parent_hash is None:
        h.update(_NO_PARENT)
    else:
        h.update(_HAS_PARENT)
        h.update(parent_hash)
    n = len(token_ids)
    h.update(struct.pack(f"<I{n}q", n, *token_ids))
    if extra_keys:
        parts: list[bytes] = []
        _encode_key(tuple(extra_keys), parts)
        h.update(b"".join(parts))
    return h.digest()


def block_extra_keys(request: Any, block_index: int, block_size: int = 0) -> tuple:
    """The extra hash keys of one block of a request: the cache salt on the first block (the chain carries
    it to every later block), the request's per-block keys (a LoRA identity) on every block, and the content
    hashes and relative offsets of the images whose placeholders the block holds."""
    keys = tuple(request.block_extra_keys)
    if block_index == 0 and request.cache_salt is not None:
        keys = (("cache_salt", request.cache_salt),) + keys
    features = getattr(request, "mm_features", None)
    if features:
        keys += mm_block_keys(features, block_index * block_size, (block_index + 1) * block_size)
    return keys


def make_block_hasher(block_size: int) -> Callable[[Any], list[BlockHash]]:
    """A request's block hasher: the hashes of the blocks that filled since its last call."""

    def hash_new_blocks(request: Any) -> list[BlockHash]:
        hashes = request.block_hashes
        start, end = len(hashes), request.num_tokens // block_size
        parent = hashes[-1] if start else None
        tokens = request.all_token_ids
        new: list[BlockHash] = []
        for i in range(start, end):
            parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size],
                                       block_extra_keys(request, i, block_size))
            new.append(parent)
        return new

    return hash_new_blocks


def hash_request_tokens(
    block_size: int,
    token_ids: Sequence[int],
    extra_keys: tuple = (),
    parent_hash: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a convenience for tests and tools)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(
            parent_hash, token_ids[start : start + block_size], extra_keys
        )
        hashes.append(parent_hash)
    return hashes


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One physical KV block; identity-compared (eq=False) so it can live in sets."""

    block_id: int
    ref_cnt: int = 0
    # Set iff this block is the one indexed under (this hash, group) in the pool's map.
    block_hash: BlockHash | None = None
    group: int = 0  # the cache group whose index holds the hash
    # Links of the doubly linked free list; both are set iff the block is in it.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    # The reserved null block (id 0) used to pad block tables; never handed out.
    is_null: bool = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle.

    The front is the least recently freed block and is evicted first. A deque
    would not do: a cached free block is pulled out of the middle when a new
    request hits it.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels keep every real node's links non-None, so "in the queue"
        # is simply "prev_free is not None".
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict next."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, in eviction order."""
        if n > self.num_free_blocks:
            raise ValueError(f"requested {n} blocks, only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        node = self._head.next_free
        for _ in range(n):
            assert node is not None
            nxt = node.next_free
            node.prev_free = node.next_free = None
            out.append(node)
            node = nxt
        self._head.next_free = node
        assert node is not None
        node.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it sits."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail: it will be evicted last."""
        if block.prev_free is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the front: it will be handed out first."""
        if block.prev_free is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append blocks in order (the first given is evicted first among them)."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front (next evicted) first. O(n): for tests and debugging."""
        out: list[KVCacheBlock] = []
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            out.append(node)
            node = node.next_free
        return out


@dataclass
class PrefixCacheStats:
    """Token-level prefix cache counters (the hit rate is hits / queries)."""

    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0
