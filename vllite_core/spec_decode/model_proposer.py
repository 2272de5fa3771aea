"""Proposers that run a model of their own beside the target (``draft_model``, ``eagle``), in the same runner.

Their KV cache follows the target's full-attention block table: every block id also has a page in the
proposer's own cache tensors (the memory of one block id counts both, so one budget serves them). The
proposer's KV at a slot is written in the same step as the target's, from the same tokens, so it is valid
exactly when the target's is: prefix-cache hits, the step back over rejected drafts and recompute after
preemption need no bookkeeping of their own.

Each step, after verification, the proposer
1. catches up: one forward over every scheduled request's newly known tokens (prompt chunks, the accepted
   drafts and the token sampled after them), which writes their KV and yields the first draft's logits;
2. drafts autoregressively: ``k - 1`` more forwards of one token per drafting request, batched (one forward
   per draft position for the whole batch). Their KV goes to the lookahead slots the scheduler holds past
   each step (``KVCacheManager.num_lookahead_tokens``) and is rewritten by the next catch-up.

Drafts are sampled from the draft's logits processed as the target's would be (constraints, penalties over
the history extended by the drafts before, temperature, top-k/top-p/min-p): greedy rows take the argmax,
random rows a sample of q, and q is kept for the verifier (``draft_probs``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllite_core.config.speculative import SpeculativeConfig
from vllite_core.core.kv_cache_spec import FullAttentionSpec
from vllite_core.errors import ConfigError
from vllite_core.sample.sampler import RowFaults, Sampler, check_finite_rows
from vllite_core.sampling_params import GREEDY_EPS
from vllite_core.spec_decode.proposer import Proposer
from vllite_core.utils import cdiv
from vllite_core.worker.kv_metadata import attention_metadata
from vllite_core.worker.sampling_inputs import build_sampling_metadata


def resolve_draft(spec_config: SpeculativeConfig) -> tuple[Any, Any]:
    """(source, hf_config) of ``speculative_config.model``; ConfigError when it names nothing loadable."""
    from model_registry.source import load_hf_config, resolve_model_source

    try:
        source = resolve_model_source(spec_config.model)
        return source, load_hf_config(source)
    except (ValueError, OSError) as e:
        raise ConfigError(f"speculative_config.model: cannot load {spec_config.model!r}: {e}") from None


def check_vocab(spec_config: SpeculativeConfig, draft_hf: Any, target_hf: Any) -> None:
    dv, tv = getattr(draft_hf, "vocab_size", None), getattr(target_hf, "vocab_size", None)
    if dv != tv:
        raise ConfigError(f"speculative_config.model: the draft's vocabulary has {dv} tokens, the target's {tv}; "
                          "a draft must share the target's tokenizer and vocabulary")


class ModelProposer(Proposer):
    """A proposer with a model of its own (the runner's hooks, ``proposer.py``); subclasses say how their
    model runs."""

    needs_lookahead = True  # the scheduler holds num_speculative_tokens slots past each step
    runs_every_step = True  # catches up on every scheduled token, prompt chunks included
    token_shift = 0  # eagle: its row at position i reads the token at i + 1

    def __init__(self, spec_config: SpeculativeConfig, config: Any = None) -> None:
        self.spec_config = spec_config
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.config = config
        self.kv_caches: list[torch.Tensor] = []
        self.layer_specs: list[FullAttentionSpec] = []
        self.group = 0  # the target's cache group whose block table the proposer follows

    # ---- set-up --------------------------------------------------------------------------
    @classmethod
    def check_config(cls, spec_config: SpeculativeConfig, target_hf_config: Any) -> None:
        """At engine start, before the target loads: the draft exists and shares the vocabulary."""
        _, draft_hf = resolve_draft(spec_config)
        check_vocab(spec_config, draft_hf, target_hf_config)

    def _set_layer_specs(self, runner: Any, specs: list[Any]) -> None:
        if any(type(s) is not FullAttentionSpec for s in specs):
            raise ConfigError("speculative_config.model: the draft has sliding-window or non-attention layers; "
                              "only full-attention drafts are supported")
        full = [g for g, grp in enumerate(runner.kv_cache_groups) if type(grp.spec) is FullAttentionSpec]
        if not full:
            raise ConfigError("speculative_config: the target has no full-attention layers whose block table "
                              "the draft could follow")
        self.group = full[0]
        self.layer_specs = specs

    def kv_bytes_per_block(self) -> int:
        return sum(s.page_bytes for s in self.layer_specs)

    def initialize_kv_cache(self, runner: Any, num_blocks: int) -> None:
        be = runner.attn_backend
        self.kv_caches = [be.allocate_kv_cache(be.get_kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads,
                                                                      s.head_size), s.dtype, runner.device)
                          for s in self.layer_specs]

    def release_kv_cache(self) -> None:
        self.kv_caches = []

    # ---- the model's part (subclasses) ---------------------------------------------------------
    def first_forward(self, runner: Any, ids: torch.Tensor, positions: torch.Tensor, md: Any,
                      target_rows: torch.Tensor, target_hidden: torch.Tensor, last: torch.Tensor
                      ) -> tuple[torch.Tensor, Any]:
        """Catch-up forward; returns (logits of the ``last`` rows, state for the next forward)."""
        raise NotImplementedError

    def next_forward(self, runner: Any, ids: torch.Tensor, positions: torch.Tensor, md: Any, state: Any,
                     keep: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """One token per drafting row (``keep``: which rows of the previous state go on)."""
        raise NotImplementedError

    # ---- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_step(self, runner: Any, inp: Any, hidden: torch.Tensor, sampled_rows: np.ndarray
                     ) -> dict[str, list[int]]:
        """Catch up on this step's tokens and draft for ``sampled_rows`` (the rows that got tokens)."""
        b = runner.batch
        bs = runner.block_size
        rows, start = inp.rows, inp.computed
        sampled = np.isin(rows, sampled_rows)
        shift = self.token_shift
        # Known tokens run through the draft (eagle: positions whose next token is known).
        end = np.minimum(b.num_computed[rows], b.num_tokens[rows] - shift)
        end = np.where(sampled, b.num_tokens[rows] - shift, end)
        cap = np.minimum(b.num_blocks[self.group, rows] * bs, runner.max_model_len)
        end = np.minimum(end, cap)
        n = np.maximum(end - start, 0)
        drafting = sampled & (end == b.num_tokens[rows] - shift) & (n > 0)
        for i in np.nonzero(drafting)[0]:
            st = b.states[rows[i]]
            if st.sampling_params.structured_outputs is not None:  # never speculated (scheduler.py)
                drafting[i] = False
        for i in np.nonzero(sampled & ~drafting)[0]:
            b.states[rows[i]].draft_probs = None
        live = n > 0
        if not live.any():
            return {}
        rows, start, n, end, drafting = rows[live], start[live], n[live], end[live], drafting[live]
        target_start = inp.query_start[live]
        total = int(n.sum())
        cu = np.cumsum(n)
        qsl = np.concatenate(([0], cu))
        req_idx = np.repeat(np.arange(len(rows)), n)
        positions = start[req_idx] + np.arange(total) - (cu - n)[req_idx]
        ids = b.token_ids[rows[req_idx], positions + shift]
        target_rows = target_start[req_idx] + positions - start[req_idx]
        md = self._attn(runner, rows, positions, req_idx, qsl, end, int(n.max()))
        dev = runner.device
        last = cu[drafting] - 1
        logits, state = self.first_forward(runner, torch.as_tensor(ids, device=dev),
                                           torch.as_tensor(positions, device=dev), md,
                                           torch.as_tensor(target_rows, device=dev), hidden,
                                           torch.as_tensor(last, device=dev))
        d_rows = rows[drafting]
        d_cap = cap[live][drafting]
        drafts: list[list[int]] = [[] for _ in d_rows]
        probs: list[list[torch.Tensor]] = [[] for _ in d_rows]
        active = np.arange(len(d_rows))
        for j in range(self.num_speculative_tokens):
            tok, q, ok = self._sample(runner, d_rows[active], logits, [drafts[a] for a in active])
            for a, t in zip(active[ok].tolist(), tok.tolist()):
                drafts[a].append(t)
            if q is not None:
                for a, qa in zip(active[ok].tolist(), q):
                    probs[a].append(qa)
            # The next forward reads the new draft at the position after the last one run.
            pos = b.num_tokens[d_rows[active]] - shift + j
            go = ok & (pos < d_cap[active])
            if j + 1 == self.num_speculative_tokens or not go.any():
                break
            keep = np.nonzero(go)[0]
            tok_keep = tok[torch.as_tensor(np.nonzero(go[ok])[0], device=tok.device)]
            active, pos = active[keep], pos[keep]
            md = self._attn(runner, d_rows[active], pos, np.arange(len(active)), np.arange(len(active) + 1),
                            pos + 1, 1)
            logits, state = self.next_forward(runner, tok_keep, torch.as_tensor(pos, device=dev), md, state,
                                              torch.as_tensor(keep, device=dev))
        out: dict[str, list[int]] = {}
        for a, r in enumerate(d_rows.tolist()):
            req = b.states[r]
            if drafts[a]:
                out[req.req_id] = drafts[a]
            req.draft_probs = torch.stack(probs[a]) if probs[a] and len(probs[a]) == len(drafts[a]) else None
        return out

    def _attn(self, runner: Any, rows: np.ndarray, positions: np.ndarray, req_idx: np.ndarray, qsl: np.ndarray,
              seq_lens: np.ndarray, max_query_len: int) -> Any:
        bs = runner.block_size
        table = runner.batch.block_tables[self.group][rows, :cdiv(int(seq_lens.max()), bs)]
        slots = table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
        return attention_metadata(runner.attn_backend, runner.device, bs, qsl, seq_lens, table, slots, max_query_len,
                                  len(positions))

    def _sample(self, runner: Any, rows: np.ndarray, logits: torch.Tensor, extra: list[list[int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor] | None, np.ndarray]:
        """Draft tokens of ``rows`` from their logits, processed as the target's would be. Returns (tokens of
        the rows that could be sampled, their q or None when all are greedy, which rows could)."""
        b = runner.batch
        ok = np.ones(len(rows), dtype=bool)
        while True:
            sel = np.nonzero(ok)[0]
            if len(sel) == 0:
                return torch.zeros(0, dtype=torch.long), None, ok
            md = build_sampling_metadata(b, rows[sel], logits.shape[-1], runner.device, runner.logits_processors,
                                         None, extra_outputs=[extra[i] for i in sel])
            try:
                x = Sampler.apply_constraints(logits[torch.as_tensor(sel, device=logits.device)].float(), md)
                check_finite_rows(x)
                break
            except RowFaults as f:  # no drafts for a faulty row: the target's own step reports it
                ok[sel[list(f.rows)]] = False
        argmax = x.argmax(dim=-1)
        if md.all_greedy:
            return argmax, None, ok
        p = Sampler.apply_sampling_params(x, md).softmax(dim=-1)
        e = torch.empty_like(p).exponential_()
        for i, gen in md.generators.items():
            e[i].exponential_(generator=gen)
        tok = torch.where(md.temperature < GREEDY_EPS, argmax, (p / e).argmax(dim=-1))
        return tok, list(p), ok
