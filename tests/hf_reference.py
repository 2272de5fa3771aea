"""Reference outputs from Hugging Face transformers on the same weights (never the code under test)."""
from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with HF's own forward and KV cache; EOS ignored (the engine runs with ignore_eos)."""
    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(max_new_tokens):
        tokens.append(nxt)
        if len(tokens) == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
    return tokens


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits at every position of ``token_ids``."""
    return model(input_ids=torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy_with(model, prompt_ids: list[int], max_new_tokens: int, transform) -> list[int]:
    """Greedy decoding where ``transform(logits[V], prompt, generated) -> logits`` edits each step's logits."""
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([prompt_ids + tokens])).logits[0, -1].float()
        tokens.append(int(transform(logits.clone(), prompt_ids, tokens).argmax()))
    return tokens
