"""Parameters with uninitialised storage (every weight comes from the checkpoint, so no init cost) and
the loaders that fill them from full checkpoint tensors."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

# Hugging Face's separate projections -> (the fused layer's name fragment, its shard): QKVParallelLinear's
# ``qkv_proj`` and MergedColumnParallelLinear's ``gate_up_proj`` as the models name them.
STACKED_PROJECTIONS = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"),
                       (".v_proj.", ".qkv_proj.", "v"), (".gate_proj.", ".gate_up_proj.", "gate"),
                       (".up_proj.", ".gate_up_proj.", "up"))


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A frozen parameter of ``shape`` whose values the checkpoint provides."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


# The storage every deferred tensor views (``deferred``).
_DEFERRED = torch.zeros(1)


def deferred(shape: tuple[int, ...]) -> torch.Tensor:
    """A stand-in of ``shape`` for a checkpoint tensor whose values are read later in another layout (a GGUF
    tensor that ``quantization="gguf"`` keeps as blocks): loaders check its shape and record its name as for any
    tensor, and ``copy_checked`` copies nothing, so the float weight it stands for is never computed or written.
    Slices of it stay deferred (they view the same storage)."""
    return _DEFERRED.expand(shape)


def is_deferred(t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == _DEFERRED.untyped_storage().data_ptr()


@torch.no_grad()
def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """``dst.copy_(src)`` after checking the shapes agree (the error names the checkpoint tensor); nothing for a
    deferred ``src``."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not match the model's "
                         f"{tuple(dst.shape)}")
    if not is_deferred(src):
        dst.copy_(src)


def check_full(src: torch.Tensor, dim: int, full: int, name: str) -> None:
    """A sharded parameter's checkpoint tensor must be whole along the split dimension."""
    if src.dim() <= dim or src.shape[dim] != full:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not have {full} rows/columns "
                         f"along dimension {dim} as the model expects")


def rows_param(rows: tuple[int, int], full: int, *rest: int, dtype: torch.dtype) -> nn.Parameter:
    """A parameter holding rows ``[start, stop)`` of a checkpoint tensor of ``full`` rows (a tensor-parallel
    rank's channels of a per-channel weight); its ``weight_loader`` takes those rows."""
    return row_ranges_param([rows], full, *rest, dtype=dtype)


def row_ranges_param(ranges: Sequence[tuple[int, int]], full: int, *rest: int, dtype: torch.dtype) -> nn.Parameter:
    """A parameter holding several row ranges of a checkpoint tensor of ``full`` rows, one after the other (a
    rank's channels of each part of a fused per-channel weight: Mamba-2's conv over x, B and C)."""
    param = empty_param(sum(stop - start for start, stop in ranges), *rest, dtype=dtype)

    @torch.no_grad()
    def load(p: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        check_full(src, 0, full, name)
        copy_checked(p.data, torch.cat([src[start:stop] for start, stop in ranges]), name)

    param.weight_loader = load  # type: ignore[attr-defined]
    return param


def load_parameter(param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
    """Fill ``param`` from a full checkpoint tensor: its ``weight_loader`` slices this rank's part."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        copy_checked(param.data, src, name)
    else:
        loader(param, src, shard, name)


@torch.no_grad()
def load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 rename: Callable[[str], str | None] = lambda n: n,
                 stacked: Sequence[tuple[str, str, str]] = ()) -> set[str]:
    """Copy each HF tensor into the parameter of the same name through its loader (``rename`` maps a
    checkpoint name to a parameter name, or None to skip it); returns the parameter names loaded. A name
    that is no parameter goes to a fused one through ``stacked`` ((fragment, fused fragment, shard)), which
    counts as loaded once every shard ``stacked`` names for it arrived. Unknown names and shape mismatches
    are errors, never silently dropped."""
    params = dict(model.named_parameters(remove_duplicate=False))
    shards_of: dict[str, set[str]] = {}
    for _, fused, shard in stacked:
        shards_of.setdefault(fused, set()).add(shard)
    arrived: dict[str, set[str]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        param = params.get(name)
        if param is not None:
            load_parameter(param, tensor, None, hf_name)
            loaded.add(name)
            continue
        target = next(((name.replace(part, fused), fused, shard) for part, fused, shard in stacked
                       if part in name and name.replace(part, fused) in params), None)
        if target is None:
            unexpected.append(hf_name)
            continue
        fused_name, fused, shard = target
        load_parameter(params[fused_name], tensor, shard, hf_name)
        arrived.setdefault(fused_name, set()).add(shard)
        if arrived[fused_name] == shards_of[fused]:
            loaded.add(fused_name)
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise ValueError(f"checkpoint has weights this model does not know: {shown}")
    return loaded
