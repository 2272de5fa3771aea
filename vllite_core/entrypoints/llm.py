"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

from typing import Any, Sequence

from vllite_core.config import EngineArgs
from vllite_core.engine.llm_engine import LLMEngine, PromptType
from vllite_core.outputs import RequestOutput
from vllite_core.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Batch generation on one engine. Engine arguments take vLLM's names."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine, llm._counter = engine, 0
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params: the list must be as long as prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority: the list must be as long as prompts")
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self.llm_engine.add_request(self._next_id(), p, sp,
                                                       priority=priority[i] if priority else 0))
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True, chat_template: str | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[index]
        prompts = [{"prompt": self.apply_chat_template(c, add_generation_prompt, chat_template, **template_kwargs)}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        tok = self.get_tokenizer()
        return tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, **kwargs)

    def _next_id(self) -> str:
        self._counter += 1
        return f"llm-{self._counter}"

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", dynamic_ncols=True)
        wanted = set(ids)
        while engine.has_unfinished_requests() and len(done) < len(ids):
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
