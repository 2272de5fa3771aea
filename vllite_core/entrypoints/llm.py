"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from vllite_core.config import EngineArgs
from vllite_core.engine.llm_engine import LLMEngine, PromptType
from vllite_core.errors import InvalidRequestError
from vllite_core.outputs import RequestOutput
from vllite_core.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vllite_core.beam_search import BeamSearchOutput
    from vllite_core.entrypoints.transcription import Transcription
    from vllite_core.pooling import (
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingParams,
        PoolingRequestOutput,
        ScoringRequestOutput,
    )

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

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation-config defaults (``generation_config``); what ``generate`` uses without params."""
        return self.llm_engine.get_default_sampling_params()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: Any = None) -> list[RequestOutput]:
        """``lora_request``: a LoRARequest for every prompt, or a list of one (or None) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        many = isinstance(sampling_params, (list, tuple))
        params = list(sampling_params) if many else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params: the list must be as long as prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority: the list must be as long as prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request: the list must be as long as prompts")
        for sp in params:  # only the final output is wanted: none is built per step (vLLM sets it too)
            if isinstance(sp, SamplingParams):
                sp.output_kind = RequestOutputKind.FINAL_ONLY
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self.llm_engine.add_request(self._next_id(), p, sp,
                                                       priority=priority[i] if priority else 0,
                                                       lora_request=loras[i]))
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False) -> list["BeamSearchOutput"]:
        """vLLM's beam search: ``params.beam_width`` best sequences per prompt (``vllite_core.beam_search``)."""
        from vllite_core.beam_search import beam_search

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tok = self.get_tokenizer()
        return beam_search(lambda asked, sp: self.generate(asked, sp, use_tqdm=use_tqdm, lora_request=lora_request),
                           list(prompts), params, self.llm_engine.eos_token_id,
                           lambda ids: tok.decode(ids, skip_special_tokens=True), lora_request)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True, chat_template: str | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: Any = None, **template_kwargs: Any) -> list[RequestOutput]:
        """vLLM's LLM.chat: ``chat_template_kwargs`` go to the template (``enable_thinking``...);
        ``continue_final_message`` leaves the last (assistant) message open for the model to go on."""

        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message",
                                      "add_generation_prompt and continue_final_message cannot both be true")
        kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        if continue_final_message:
            kwargs["continue_final_message"] = True
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[index]
        prompts = [self._chat_prompt(c, add_generation_prompt, chat_template, kwargs) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _chat_prompt(self, conversation: Conversation, add_generation_prompt: bool, chat_template: str | None,
                     kwargs: dict[str, Any]) -> dict[str, Any]:
        """The rendered conversation; image parts (``image_url``, ``image_pil``) become placeholders with their
        images in ``multi_modal_data`` (vllite_core.multimodal.chat)."""
        from vllite_core.multimodal.chat import chat_engine_prompt

        return chat_engine_prompt(self.llm_engine, list(conversation), lambda msgs: self.apply_chat_template(
            msgs, add_generation_prompt, chat_template, **kwargs))

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        tok = self.get_tokenizer()
        return tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, **kwargs)

    def transcribe(self, audio: Any, sampling_params: SamplingParams | None = None, language: str | None = "en",
                   task: str = "transcribe", prompt: str | None = None, timestamps: bool = False,
                   use_tqdm: bool = False) -> list["Transcription"]:
        """Speech to text with a speech model (Whisper). ``audio``: a WAV path or bytes, ``(samples,
        sample_rate)``, a 1-D float array at 16 kHz, or a list of these; one ``Transcription`` each
        (``.text``, ``.language``, ``.windows``: one RequestOutput per window). Audio longer than the
        model's window (30 s) is split into windows whose texts are joined. ``language=None`` (or
        "auto") detects it; ``prompt`` is earlier text to condition on. Greedy by default."""
        from vllite_core.entrypoints import transcription as tr

        engine = self.llm_engine
        tr.check_transcription_model(engine)
        items = list(audio) if isinstance(audio, list) else [audio]
        ctx = engine.input_context
        window_s = float(engine.model_cls.max_audio_seconds(ctx))
        decoded = [tr.as_audio(a) for a in items]
        languages: list[str | None] = [language] * len(items)
        if language in tr.AUTO_LANGUAGE:
            reqs = [tr.detection_request(engine.model_cls, ctx, s, sr, window_s) for s, sr in decoded]
            asked = [i for i, r in enumerate(reqs) if r is not None]
            if asked:
                outs = self.generate([reqs[i][0] for i in asked], [reqs[i][1] for i in asked])
                for i, o in zip(asked, outs):
                    languages[i] = reqs[i][2][o.outputs[0].token_ids[0]]
            languages = [None if lang == "auto" else lang for lang in languages]
        prompts, owner = [], []
        for i, ((samples, sr), lang) in enumerate(zip(decoded, languages)):
            windows = tr.window_prompts(samples, sr, window_s, lang, task, prompt, timestamps)
            prompts += windows
            owner += [i] * len(windows)
        outputs = self.generate(prompts, tr.default_params(sampling_params), use_tqdm=use_tqdm)
        results = []
        for i, ((samples, sr), lang) in enumerate(zip(decoded, languages)):
            mine = [o for o, k in zip(outputs, owner) if k == i]
            results.append(tr.Transcription(tr.join_text(mine), lang, len(samples) / sr, mine))
        return results

    # ---- pooling models (vllite_core.pooling) ----------------------------------------------------
    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: "PoolingParams | None" = None,
               use_tqdm: bool = False, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None) -> list["PoolingRequestOutput"]:
        """The model's pooled output per prompt (``.outputs.data``, a float32 tensor)."""
        from vllite_core.pooling import PoolingParams
        from vllite_core.pooling.outputs import as_pooling_output
        from vllite_core.pooling.requests import batch_tokenize

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = batch_tokenize(self.get_tokenizer(), list(prompts))
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = PoolingParams(**{**params.__dict__, "truncate_prompt_tokens": truncate_prompt_tokens})
        if pooling_task is not None:
            params = params.with_task(pooling_task)  # type: ignore[arg-type]
        ids: list[str] = []
        try:
            for p in prompts:
                ids.append(self.llm_engine.add_request(self._next_id(), p, params))
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return [as_pooling_output(o) for o in self._run(ids, use_tqdm)]

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: "PoolingParams | None" = None,
              use_tqdm: bool = False, truncate_prompt_tokens: int | None = None) -> list["EmbeddingRequestOutput"]:
        from vllite_core.pooling import EmbeddingRequestOutput

        outs = self.encode(prompts, pooling_params, use_tqdm, "embed", truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: "PoolingParams | None" = None,
                 use_tqdm: bool = False,
                 truncate_prompt_tokens: int | None = None) -> list["ClassificationRequestOutput"]:
        from vllite_core.pooling import ClassificationRequestOutput

        outs = self.encode(prompts, pooling_params, use_tqdm, "classify", truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(self, prompts: PromptType | Sequence[PromptType], pooling_params: "PoolingParams | None" = None,
               use_tqdm: bool = False, truncate_prompt_tokens: int | None = None) -> list["PoolingRequestOutput"]:
        return self.encode(prompts, pooling_params, use_tqdm, "reward", truncate_prompt_tokens)

    def score(self, data_1: str | list[str], data_2: str | list[str], use_tqdm: bool = False,
              pooling_params: "PoolingParams | None" = None,
              truncate_prompt_tokens: int | None = None) -> list["ScoringRequestOutput"]:
        """Relevance of each (data_1, data_2) pair (one against many, or pairwise): a cross-encoder's
        score, or the cosine similarity of an embedding model's embeddings."""
        from vllite_core.pooling import ScoringRequestOutput
        from vllite_core.pooling import scoring as sc

        pairs = sc.score_pairs(data_1, data_2)
        cfg = self.llm_engine.config.model_config.pooler_config
        if cfg is not None and cfg.task == "embed":
            texts = [t for pair in pairs for t in pair]
            embs = self.encode(texts, pooling_params, use_tqdm, "embed", truncate_prompt_tokens)
            return [ScoringRequestOutput.from_score(a.request_id, None if a.error or b.error else
                                                    sc.cosine(a.outputs.data, b.outputs.data),
                                                    a.prompt_token_ids + b.prompt_token_ids, a.error or b.error)
                    for a, b in zip(embs[0::2], embs[1::2])]
        tok = self.get_tokenizer()
        outs = self.encode([sc.pair_prompt(tok, a, b) for a, b in pairs], pooling_params, use_tqdm, "score",
                           truncate_prompt_tokens)
        return [ScoringRequestOutput.from_score(o.request_id, None if o.error else float(o.outputs.data[0]),
                                                o.prompt_token_ids, o.error) for o in outs]

    # ---- sleep mode, collective_rpc, weight updates (docs/sleep_mode.md) ---------------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Release the KV cache (level 1) and the weights too (level 2), giving their memory back, until
        ``wake_up``; requests meanwhile raise EngineSleepingError. Needs ``enable_sleep_mode=True``. On a CPU,
        level 1 keeps the weights where they are; on a device they move to host memory. Level 2's wake reloads
        the weights from the checkpoint. ``mode`` as vLLM's: "abort" (default) or "wait" for requests in
        flight (``generate`` returns with none, so offline both simply sleep); "keep" is refused."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``tags`` ["weights"] and/or ["kv_cache"] (None: both), so a
        trainer can load new weights before the KV cache takes its memory back."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method`` on every worker (every tensor-parallel rank): a worker method by name
        (``load_weights``, ``reload_weights``, ``sleep``...) or a function called with the worker first
        (pickled to worker processes); each rank's result, in rank order. After ``load_weights`` /
        ``reload_weights`` the prefix cache is reset (its K/V came from the old weights); after a function
        of your own that changes weights, call ``reset_prefix_cache()``."""
        return self.llm_engine.collective_rpc(method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (False when running requests still hold blocks)."""
        return self.llm_engine.reset_prefix_cache()

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
