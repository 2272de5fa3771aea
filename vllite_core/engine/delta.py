"""What a caller sees of a request while it runs: one implementation for both fronts.

The output processor builds *cumulative* RequestOutputs (all text and tokens so
far). A ``DeltaCursor`` follows one request and turns each cumulative output into
what the caller is shown:

- text that could still turn out to be the start of a stop string is held back
  (the last ``max_stop_str_len - 1`` characters) until the completion finishes, so
  streamed deltas always concatenate to the final text;
- ``delta()`` gives only what is new since the last call: only the completions
  that changed, a completion's finish reported once, prompt logprobs sent once,
  and None when nothing changed;
- ``cumulative()`` gives everything so far, with the same hold-back.

Token ids and logprobs are cut at the token count of the output given, so a cursor
may read an output whose logprob lists are still growing on another thread (the
async engine loop).

Used by ``LLMEngine.step(delta=True)`` (on the engine's thread) and by
``AsyncLLM`` (on the asyncio side, from the loop's cumulative outputs).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllite_core.outputs import CompletionOutput, RequestOutput


@dataclass
class _Sent:
    """How much of one completion the caller has been shown."""

    text_len: int = 0
    num_tokens: int = 0
    done: bool = False


class DeltaCursor:
    def __init__(self, max_stop_str_len: int) -> None:
        self.hold = max(max_stop_str_len - 1, 0)
        self._sent: dict[int, _Sent] = {}  # completion index -> what was shown
        self._sent_prompt_logprobs = False

    def _shown(self, c: CompletionOutput) -> str:
        if c.finish_reason is not None or not self.hold:
            return c.text
        return c.text[:max(len(c.text) - self.hold, 0)]

    def cumulative(self, out: RequestOutput) -> RequestOutput:
        """Everything so far, less the text a stop string may still take back."""
        comps = []
        for c in out.outputs:
            n = len(c.token_ids)
            comps.append(dataclasses.replace(c, text=self._shown(c), token_ids=list(c.token_ids),
                                             logprobs=c.logprobs[:n] if c.logprobs is not None else None))
        return dataclasses.replace(out, outputs=comps)

    def delta(self, out: RequestOutput) -> RequestOutput | None:
        """Only what is new since the last call; None when nothing is."""
        comps: list[CompletionOutput] = []
        for c in out.outputs:
            sent = self._sent.setdefault(c.index, _Sent())
            if sent.done:
                continue
            done = c.finish_reason is not None
            shown, n = self._shown(c), len(c.token_ids)
            piece, toks = shown[sent.text_len:], c.token_ids[sent.num_tokens:n]
            if not (piece or toks or done):
                continue
            lps = c.logprobs[sent.num_tokens:n] if c.logprobs is not None else None
            comps.append(dataclasses.replace(c, text=piece, token_ids=toks, logprobs=lps))
            sent.text_len, sent.num_tokens, sent.done = max(len(shown), sent.text_len), n, done
        prompt_logprobs = None
        if not self._sent_prompt_logprobs and out.prompt_logprobs is not None:
            prompt_logprobs, self._sent_prompt_logprobs = out.prompt_logprobs, True
        if not comps and prompt_logprobs is None:
            return None
        return dataclasses.replace(out, outputs=comps, prompt_logprobs=prompt_logprobs)

    def view(self, out: RequestOutput, delta: bool) -> RequestOutput | None:
        return self.delta(out) if delta else self.cumulative(out)
