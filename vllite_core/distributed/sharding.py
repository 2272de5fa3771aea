"""How a model's dimensions split over tensor-parallel ranks, and which sizes cannot.

Attention splits by whole KV-head groups (each rank keeps its query heads with the KV heads they
read), as evenly as the group count allows: SmolLM2's 3 KV heads over 2 ranks give 2 groups and 1.
vLLM requires an even split; an uneven one is exact too (heads are independent), and without it
the default model (9 heads) could not run on 2 ranks. With more ranks than KV heads each KV head is
replicated on ``tp / num_kv_heads`` ranks, which needs ``tp`` to divide the query heads and be a
multiple of the KV heads. The vocabulary splits into equal padded shards (``all_gather`` needs
equal sizes); other dimensions (MLP width) split near-evenly.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllite_core.errors import ConfigError


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``n`` splits into ``parts`` contiguous near-equal parts."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads and the KV heads they read."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def check_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """ConfigError naming ``tensor_parallel_size`` when the heads cannot be split over ``tp`` ranks."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_key_value_heads: {num_kv_heads} does not divide num_attention_heads={num_heads}")
    if tp <= num_kv_heads:
        return
    if num_heads % tp or tp % num_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size: {tp} ranks is more than the model's {num_kv_heads} KV heads, so each KV "
            f"head is replicated, which needs {tp} to divide num_attention_heads={num_heads} and to be a "
            f"multiple of num_key_value_heads={num_kv_heads}; use at most {num_kv_heads} ranks")


def shard_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    check_heads(num_heads, num_kv_heads, tp)
    group = num_heads // num_kv_heads  # query heads per KV head
    if tp <= num_kv_heads:
        kv_start, kv_stop = split(num_kv_heads, tp, rank)
        return HeadShard(kv_start * group, (kv_stop - kv_start) * group, kv_start, kv_stop - kv_start)
    per_rank = num_heads // tp
    return HeadShard(rank * per_rank, per_rank, rank * per_rank // group, 1)


@dataclass(frozen=True)
class VocabShard:
    """Rows ``[start, stop)`` of the vocabulary on one rank, stored in ``padded`` rows (equal on every rank)."""

    start: int
    stop: int
    padded: int
    vocab_size: int

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.stop == self.vocab_size == self.padded


def shard_vocab(vocab_size: int, tp: int, rank: int) -> VocabShard:
    padded = -(-vocab_size // tp)
    start = min(rank * padded, vocab_size)
    return VocabShard(start, min(start + padded, vocab_size), padded, vocab_size)


def shard_experts(num_experts: int, tp: int, rank: int) -> tuple[int, int]:
    """Expert parallelism: the experts ``[start, stop)`` rank ``rank`` of ``tp`` holds whole, an equal share
    each; ConfigError naming ``enable_expert_parallel`` when the experts do not divide evenly."""
    if num_experts % tp:
        raise ConfigError(f"enable_expert_parallel: {num_experts} experts do not split evenly over "
                          f"tensor_parallel_size={tp} ranks; use a rank count that divides {num_experts}, or "
                          "leave expert parallelism off (each expert's width is split instead)")
    per_rank = num_experts // tp
    return rank * per_rank, (rank + 1) * per_rank
