"""Graph capture of the decode step: the pieces a platform and the model runner share.

The contract (``Platform.capture_graphs``): the runner hands the platform

- ``forward(**inputs)``: one step of the model (``input_ids``, ``positions``,
  ``kv_caches``, ``metadata``) returning hidden states;
- ``batch_sizes``: the decode batch sizes to capture (``capture_sizes``);
- ``make_inputs(bs)``: static input buffers for ``bs`` decode requests
  (``decode_inputs``), which the captured graph reads on every replay.

and gets back ``{bs: GraphRunner}``. For a decode-only step of ``n`` requests
the runner picks the smallest captured ``bs >= n`` (``pick_batch_size``), pads
its inputs to ``bs`` (``pad_decode_inputs``) and calls ``runners[bs](**inputs)``:
the runner copies the inputs into its static buffers, replays, and returns the
static output (valid until the next replay; the first ``n`` rows are real).

How a platform captures is its own business; ``capture_runners`` does the
bookkeeping given a ``capture(fn) -> replay`` function, and
``stream_graph_capture`` builds that function for devices with torch's
CUDA-style graph API (torch's cuda and xpu modules), passed in as a module so
the core imports no device module.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllite_core.attention.backend import AttentionMetadata

Capture = Callable[[Callable[[], Any]], Callable[[], Any]]


def capture_sizes(max_num_seqs: int, limit: int = 256) -> list[int]:
    """Decode batch sizes worth a graph: 1, 2, 4, then every multiple of 8, up to ``min(max_num_seqs, limit)``."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] < top:
        sizes.append(top)
    return sizes


def pick_batch_size(num_reqs: int, captured: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` requests (None: run eagerly)."""
    fits = [s for s in captured if s >= num_reqs]
    return min(fits) if fits else None


def pow2_bucket(n: int, minimum: int = 16, maximum: int | None = None) -> int:
    """``n`` rounded up to a power of two (at least ``minimum``): padded static shapes for compilers."""
    b = max(minimum, 1 << max(0, (max(n, 1) - 1).bit_length()))
    if maximum is not None and n <= maximum:
        b = min(b, maximum)
    return b


def decode_inputs(batch_size: int, max_blocks: int, kv_caches: list[torch.Tensor], block_size: int,
                  device: torch.device | str) -> dict[str, Any]:
    """Static buffers for ``batch_size`` decode requests (one new token each) at block-table width ``max_blocks``.

    Until real inputs are copied in they describe requests of one token whose
    K/V go nowhere (slot -1) and which read block 0, the null block."""
    dev = torch.device(device)
    md = AttentionMetadata(
        num_actual_tokens=batch_size,
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.ones(batch_size, dtype=torch.int32, device=dev),
        block_table=torch.zeros(batch_size, max_blocks, dtype=torch.int32, device=dev),
        slot_mapping=torch.full((batch_size,), -1, dtype=torch.int64, device=dev),
        max_query_len=1, max_seq_len=1, block_size=block_size,
        query_start_loc_cpu=list(range(batch_size + 1)), seq_lens_cpu=[1] * batch_size)
    return {"input_ids": torch.zeros(batch_size, dtype=torch.long, device=dev),
            "positions": torch.zeros(batch_size, dtype=torch.long, device=dev),
            "kv_caches": kv_caches, "metadata": md}


def pad_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      batch_size: int) -> dict[str, Any]:
    """A decode step of ``n <= batch_size`` requests padded to ``batch_size``: the extra requests have one
    token each, at slot -1 (written nowhere), reading block 0. ``num_actual_tokens`` stays ``n``."""
    n = int(input_ids.shape[0])
    if metadata.max_query_len != 1 or n != metadata.num_reqs:
        raise ValueError("pad_decode_inputs: only decode steps (one token per request) are padded")
    if n > batch_size:
        raise ValueError(f"pad_decode_inputs: {n} requests do not fit a batch of {batch_size}")
    pad = batch_size - n
    dev = input_ids.device
    md = dataclasses.replace(
        metadata,
        query_start_loc=torch.cat([metadata.query_start_loc,
                                   metadata.query_start_loc[-1:] + torch.arange(1, pad + 1, dtype=torch.int32,
                                                                                device=dev)]),
        seq_lens=torch.cat([metadata.seq_lens, torch.ones(pad, dtype=metadata.seq_lens.dtype, device=dev)]),
        block_table=torch.cat([metadata.block_table,
                               metadata.block_table.new_zeros(pad, metadata.block_table.shape[1])]),
        slot_mapping=torch.cat([metadata.slot_mapping,
                                torch.full((pad,), -1, dtype=metadata.slot_mapping.dtype, device=dev)]),
        query_start_loc_cpu=list(metadata.query_start_loc_cpu) + [n + i for i in range(1, pad + 1)],
        seq_lens_cpu=list(metadata.seq_lens_cpu) + [1] * pad, extra=None)
    return {"input_ids": torch.cat([input_ids, input_ids.new_zeros(pad)]),
            "positions": torch.cat([positions, positions.new_zeros(pad)]), "metadata": md}


def copy_into(static: Any, new: Any) -> Any:
    """Copy ``new`` into the static buffers ``static`` (same structure) and return ``static``.

    Tensors are copied in place (into the leading slice when ``new`` is smaller, e.g. a narrower block table);
    the same tensor object is skipped (the KV caches); dict/list items recurse; a dataclass's tensor fields are
    copied and its other fields (the metadata's host copies, ``extra``) replaced, since only eager replays read
    them."""
    if static is new:
        return static
    if isinstance(static, torch.Tensor):
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"static input is a tensor, got {type(new).__name__}")
        if new.dim() != static.dim() or any(a > b for a, b in zip(new.shape, static.shape)):
            raise ValueError(f"input of shape {tuple(new.shape)} does not fit the static {tuple(static.shape)}")
        static[tuple(slice(0, s) for s in new.shape)].copy_(new)
        return static
    if dataclasses.is_dataclass(static) and not isinstance(static, type):
        for f in dataclasses.fields(static):
            old, val = getattr(static, f.name), getattr(new, f.name)
            if isinstance(old, torch.Tensor):
                copy_into(old, val)
            else:
                setattr(static, f.name, val)
        return static
    if isinstance(static, dict):
        for k, v in new.items():
            if k not in static:
                raise KeyError(f"input {k!r} was not captured")
            if isinstance(static[k], (torch.Tensor, dict, list, tuple)) or dataclasses.is_dataclass(static[k]):
                copy_into(static[k], v)
            else:
                static[k] = v
        return static
    if isinstance(static, (list, tuple)):
        if len(static) != len(new):
            raise ValueError(f"expected {len(static)} items, got {len(new)}")
        for s, v in zip(static, new):
            copy_into(s, v)
        return static
    return new


@dataclasses.dataclass
class GraphRunner:
    """One captured batch size: static inputs, and a ``replay`` returning the static output."""

    batch_size: int
    static_inputs: dict[str, Any]
    replay: Callable[[], Any]
    memory_bytes: int = 0  # device memory its capture took (inputs, graph, pool growth), where measurable

    def __call__(self, **inputs: Any) -> Any:
        with torch.inference_mode():
            copy_into(self.static_inputs, inputs)
            return self.replay()


def capture_runners(forward: Callable[..., Any], batch_sizes: Sequence[int],
                    make_inputs: Callable[[int], dict[str, Any]], capture: Capture) -> dict[int, GraphRunner]:
    """``capture(fn)`` turns a zero-argument step into a replay function; sizes go largest first (so a shared
    memory pool sized by the largest graph serves the rest). A capture with a ``memory_in_use()`` method
    (``StreamGraphCapture``) has each size's memory measured: the KV cache was sized before capture, so this
    is what graphs take beyond it."""
    measure = getattr(capture, "memory_in_use", None)
    runners: dict[int, GraphRunner] = {}
    with torch.inference_mode():
        for bs in sorted(set(int(b) for b in batch_sizes), reverse=True):
            before = measure() if measure else 0
            static = make_inputs(bs)
            replay = capture(lambda static=static: forward(**static))
            runners[bs] = GraphRunner(bs, static, replay, (measure() - before) if measure else 0)
    return runners


def eager_capture(fn: Callable[[], Any]) -> Callable[[], Any]:
    """A 'capture' that replays by calling the step again: static-buffer semantics, no device graph."""
    return fn


class StreamGraphCapture:
    """Capture for devices with torch's CUDA-style graph API: ``mod`` is the device module (torch's cuda or
    xpu module), ``graph_factory`` makes an empty graph (that module's graph class). Warm-up runs go on
    a side stream (kernel compilation and allocator growth must not be captured); all graphs share one pool.

    One side stream serves every size: the caching allocator keeps blocks per stream and cuBLAS a workspace
    per stream (32 MiB on Hopper), so a stream per size took 1,230 MiB for SmolLM2's 36 sizes on an H200."""

    def __init__(self, mod: Any, graph_factory: Callable[[], Any], warmup: int = 2) -> None:
        self.mod, self.graph_factory, self.warmup = mod, graph_factory, warmup
        self.pool = mod.graph_pool_handle()
        self.side = mod.Stream()

    def memory_in_use(self) -> int:
        """Device bytes in use by anyone (the driver's view: graphs live outside torch's allocator stats)."""
        if not hasattr(self.mod, "mem_get_info"):
            return 0
        self.mod.synchronize()
        free, total = self.mod.mem_get_info()
        return int(total - free)

    def __call__(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        mod, side = self.mod, self.side
        side.wait_stream(mod.current_stream())
        with mod.stream(side):
            for _ in range(self.warmup):
                fn()
        mod.current_stream().wait_stream(side)
        mod.synchronize()
        graph = self.graph_factory()
        with mod.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> Any:
            graph.replay()
            return out

        return replay


def stream_graph_capture(mod: Any, graph_factory: Callable[[], Any], warmup: int = 2) -> Capture:
    """``StreamGraphCapture`` for ``mod`` (the name the platforms call)."""
    return StreamGraphCapture(mod, graph_factory, warmup)
