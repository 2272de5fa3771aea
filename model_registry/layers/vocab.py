"""The vocabulary: token embedding and LM head, split by token rows over tensor-parallel ranks.

Each rank holds a block of token rows (``sharding.shard_vocab``; padded rows zero); lookups of other ranks'
tokens give zeros and the all-reduce fills them in; the LM head's logits are gathered. The head may be tied
to the embedding (the same parameter) and holds its own quantization (int8 rows, GGUF blocks) beside the float
table the lookup keeps; with GGUF blocks on one rank the lookup reads them too and the float table goes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers.params import check_full, copy_checked
from model_registry.layers.quantization.base import UNQUANTIZED, LinearMethod
from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import VocabShard, shard_vocab
from vllite_core.model_ops import ModelOps, current_model_ops

if TYPE_CHECKING:
    from model_registry.layers.quantization.gguf import GGUFWeight


def vocab_parameter(vocab_size: int, hidden_size: int, dtype: torch.dtype) -> tuple[nn.Parameter, VocabShard]:
    """This rank's block of an embedding / LM-head matrix (padded rows zero) and where it sits."""
    tp = get_tp()
    shard = shard_vocab(vocab_size, tp.world_size, tp.rank)
    param = nn.Parameter(torch.empty(shard.padded, hidden_size, dtype=dtype), requires_grad=False)

    @torch.no_grad()
    def load(p: torch.Tensor, src: torch.Tensor, _shard: str | None, name: str) -> None:
        check_full(src, 0, vocab_size, name)
        n = shard.stop - shard.start
        copy_checked(p.data[:n], src[shard.start:shard.stop], name)
        p.data[n:].zero_()

    param.weight_loader = load  # type: ignore[attr-defined]
    return param, shard


def vocab_embedding(input_ids: torch.Tensor, weight: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Embedding rows of ``input_ids``: this rank's rows, zeros elsewhere, summed over ranks (exact)."""
    if shard.is_whole:
        return F.embedding(input_ids, weight)
    inside = (input_ids >= shard.start) & (input_ids < shard.stop)
    x = F.embedding(torch.where(inside, input_ids - shard.start, 0), weight)
    x.masked_fill_(~inside.unsqueeze(-1), 0)
    return get_tp().communicator.all_reduce(x)


def gather_logits(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Logits over the whole vocabulary from every rank's block (the padding dropped)."""
    if shard.is_whole:
        return local
    return get_tp().communicator.all_gather(local, dim=-1)[..., :shard.vocab_size]


class VocabParallelEmbedding(nn.Module):
    """Token embedding, this rank's block of rows (the whole table on one rank); or, on one rank, the rows looked up
    in a GGUF tensor's blocks (``use_blocks``)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.shard = vocab_parameter(vocab_size, hidden_size, dtype)
        self.blocks: GGUFWeight | None = None

    def use_blocks(self, w: GGUFWeight) -> None:
        """Look rows up in ``w`` (quantization="gguf": the table's GGUF blocks, which a tied LM head may share) and
        drop the float table (``weight`` becomes an empty placeholder)."""
        self.blocks = w
        self.ops = current_model_ops()
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:  # the placeholder keeps the model dtype
            return self.ops.gguf_embedding(input_ids, self.blocks, self.weight.dtype)
        return vocab_embedding(input_ids, self.weight, self.shard)


class ParallelLMHead(nn.Module):
    """Logits over the vocabulary. ``tied``: the embedding whose table is the head. The product goes through
    ``quant_method`` (``model_registry.layers.quantization``): the float table, or its int8 rows / GGUF blocks
    (which leave the table itself for the lookup)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied: VocabParallelEmbedding | None = None, ops: ModelOps | None = None) -> None:
        super().__init__()
        if tied is not None:
            self.weight, self.shard = tied.weight, tied.shard
        else:
            self.weight, self.shard = vocab_parameter(vocab_size, hidden_size, dtype)
        self.tied = tied is not None
        self.ops = ops or current_model_ops()
        self.state: dict = {}
        self.quant_method: LinearMethod = UNQUANTIZED

    def set_quant_method(self, method: LinearMethod) -> None:
        self.quant_method = method
        self.state = {}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in the model dtype (the sampler widens them where it computes with them)."""
        return gather_logits(self.quant_method.apply(self, hidden_states, None), self.shard)
