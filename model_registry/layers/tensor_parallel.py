"""Tensor-parallel support declared once for models whose sharding is their attention heads.

A model built from the parallel layers (``QKVParallelLinear``, ``RowParallelLinear``, ...) shards as it is
built; what it must still tell the engine, before any worker starts, is whether its checkpoint splits over the
ranks: the heads (``vllite_core.distributed.sharding.check_heads``). ``ShardsByHeads`` says that from the
config, so a new model (an encoder, a decoder, a vision-language model whose language model alone is sharded)
gets the declaration by inheriting it, and ``vllite env --model`` shows each rank's heads. A hybrid adds its
other mixers' split (``ShardsHybrid``; ``ShardsMamba2Hybrid`` for the Mamba-2 mixer's whole heads).
"""
from __future__ import annotations

from typing import Any

from model_registry.layers.mamba import check_mamba2_split, mamba2_shard
from vllite_core.distributed.sharding import check_heads, shard_heads
from vllite_core.model_interfaces import SupportsTensorParallel


class ShardsByHeads(SupportsTensorParallel):
    """Declares ``SupportsTensorParallel``: the heads of ``hf_config`` (or of its ``tp_sub_config``, such as a
    VLM's ``text_config``) must split over the ranks; other sizes split near-evenly (a model without attention,
    Mamba, has nothing to check: its mixers split their channels)."""

    tp_sub_config: str | None = None
    whole_elsewhere = "the rest whole on every rank"  # what the layout says of the parts beside tp_sub_config

    @classmethod
    def sharded_config(cls, hf_config: Any) -> Any:
        """The config whose heads are split (a VLM's text config; the model's own otherwise)."""
        return getattr(hf_config, cls.tp_sub_config) if cls.tp_sub_config else hf_config

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """SupportsTensorParallel: ConfigError naming ``tensor_parallel_size`` when the heads cannot split."""
        c = cls.sharded_config(hf_config)
        heads = getattr(c, "num_attention_heads", None)
        if heads is None:
            return
        check_heads(heads, getattr(c, "num_key_value_heads", None) or heads, tensor_parallel_size)

    @classmethod
    def tensor_parallel_layout(cls, hf_config: Any, tensor_parallel_size: int) -> list[str]:
        """Each rank's attention heads, as ``vllite env`` prints them (the split is uneven where the KV-head
        groups are: ``sharding.shard_heads``)."""
        c = cls.sharded_config(hf_config)
        heads = getattr(c, "num_attention_heads", None)
        if heads is None:
            return []
        kv = getattr(c, "num_key_value_heads", None) or heads
        where = f" ({cls.tp_sub_config}; {cls.whole_elsewhere})" if cls.tp_sub_config else ""
        lines = []
        for rank in range(tensor_parallel_size):
            s = shard_heads(heads, kv, tensor_parallel_size, rank)
            lines.append(f"tensor-parallel rank {rank}: query heads {_span(s.q_start, s.num_heads)} of {heads}, "
                         f"KV heads {_span(s.kv_start, s.num_kv_heads)} of {kv}{where}")
        return lines


def _span(start: int, count: int) -> str:
    return f"{start}-{start + count - 1} ({count})"


class ShardsHybrid(ShardsByHeads):
    """Declares ``SupportsTensorParallel`` for a model whose attention splits by heads (``ShardsByHeads``) and whose
    other mixers (or encoder) split their own way: a subclass says how (``check_mixers``) and what each rank holds
    (``mixer_layout``), both from the whole ``hf_config``, and ``vllite env`` prints both on each rank's line."""

    @classmethod
    def check_mixers(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """ConfigError naming ``tensor_parallel_size`` when the mixers cannot split (nothing to check by default)."""

    @classmethod
    def mixer_layout(cls, hf_config: Any, tensor_parallel_size: int, rank: int) -> str:
        raise NotImplementedError

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        super().check_tensor_parallel(hf_config, tensor_parallel_size)
        cls.check_mixers(hf_config, tensor_parallel_size)

    @classmethod
    def tensor_parallel_layout(cls, hf_config: Any, tensor_parallel_size: int) -> list[str]:
        attention, c = super().tensor_parallel_layout(hf_config, tensor_parallel_size), hf_config
        return [f"{attention[r]}; {cls.mixer_layout(c, tensor_parallel_size, r)}" if attention
                else f"tensor-parallel rank {r}: {cls.mixer_layout(c, tensor_parallel_size, r)}"
                for r in range(tensor_parallel_size)]


class ShardsMamba2Hybrid(ShardsHybrid):
    """``ShardsHybrid`` for models built on ``Mamba2Mixer``: each mixer holds whole heads and the B/C groups they
    read (``layers.mamba.mamba2_shard``). ``mamba2_fields``: the config's names of the mixer's heads and groups."""

    mamba2_fields: tuple[str, str] = ("num_heads", "n_groups")

    @classmethod
    def _mamba2(cls, c: Any) -> tuple[int, int]:
        heads, groups = cls.mamba2_fields
        return int(getattr(c, heads)), int(getattr(c, groups))

    @classmethod
    def check_mixers(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        check_mamba2_split(*cls._mamba2(hf_config), tensor_parallel_size)

    @classmethod
    def mixer_layout(cls, hf_config: Any, tensor_parallel_size: int, rank: int) -> str:
        heads, groups = cls._mamba2(hf_config)
        sh = mamba2_shard(heads, groups, tensor_parallel_size, rank)
        (h0, h1), (g0, g1) = sh.heads, sh.groups
        return f"SSM heads {_span(h0, h1 - h0)} of {heads}, groups {g0}-{g1 - 1} of {groups}"
