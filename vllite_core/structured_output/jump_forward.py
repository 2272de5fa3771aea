"""Jump-forward decoding: where a request's grammar allows exactly one next token, that token is appended
at once instead of costing a sampling step (``structured_outputs_config={"jump_forward": True}``, or
``jump_forward=True`` / ``--jump-forward``).

The rule is token-level: the backend's bitmask must allow one token and nothing else. Masked sampling,
greedy or random, can only pick that token, so outputs are what the engine would produce without jumping
(a seeded sampled request draws from its generator fewer times, so its later tokens differ, still valid).
A string-level jump (xgrammar's ``find_jump_forward_string``) would have to choose a tokenization the
model might not have chosen; this rule never does. The jumped tokens are then computed in the next step
with the token sampled before them, as a prompt tail is: the scheduler gives the request several tokens.

Where the rule would decide something the sampler decides otherwise, the request does not jump:
- it asks for logprobs: a jumped token was not sampled, so it has no logprobs to report; rather than
  invent them (0.0 is right only for ``processed_logprobs``), such requests decode token by token;
- ``allowed_token_ids`` or ``bad_words`` could forbid the forced token (the sampler would then fail the
  row), and before ``min_tokens`` EOS and stop ids are banned: the jump stops there;
- EOS is jumped only where it would end the request (``ignore_eos`` off, ``min_tokens`` reached).
Global logits processors are assumed not to forbid a token the grammar forces.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllite_core.request import Request


def can_jump(req: "Request") -> bool:
    g = req.structured_output
    if g is None or not g.jump_forward or g.matcher is None:
        return False
    p = req.sampling_params
    return p.logprobs is None and not p.allowed_token_ids and not p.bad_words_token_ids


def next_forced_token(req: "Request", room: int) -> int | None:
    """The token to append now without sampling (``room``: how many more the request may have), or None."""
    if room <= 0:
        return None
    tok = req.structured_output.forced_token()
    if tok is None:
        return None
    p = req.sampling_params
    early = req.num_output_tokens < p.min_tokens
    if tok == req.eos_token_id and (p.ignore_eos or early):
        return None
    if early and tok in p.stop_token_ids:  # type: ignore[operator]
        return None
    return tok
