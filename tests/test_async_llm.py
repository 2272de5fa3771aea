"""AsyncLLM on a tiny random Llama: streamed outputs equal the sync engine's, aborts free the
KV blocks, bad requests fail before anything is queued; and the delta view never shows text
that a stop string will take back."""
from __future__ import annotations

import asyncio

import pytest

from tiny_models import TINY, save_tiny
from vllite_core import LLM, SamplingParams
from vllite_core.config import EngineArgs
from vllite_core.engine.async_llm import AsyncLLM, RequestStream
from vllite_core.engine.errors import InvalidRequestError, PromptTooLongError
from vllite_core.engine.llm_engine import LLMEngine
from vllite_core.outputs import CompletionOutput, RequestOutput

ENGINE = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    return str(path)


@pytest.fixture
def allm(tiny_path):
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=tiny_path, scheduling_policy="priority",
                                                               **ENGINE))
    a = AsyncLLM(engine)
    yield a
    a.close()


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(n)]


def test_streams_match_the_sync_engine(allm, tiny_path):
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=2) for i in range(6)]
    ref = LLM(model=tiny_path, **ENGINE).generate([{"prompt_token_ids": p} for p in prompts(6)], params)

    async def one(i: int, p: list[int]) -> tuple[list[int], str, RequestOutput]:
        toks, text, last = [], "", None
        async for out in allm.generate({"prompt_token_ids": p}, params[i], f"r{i}", delta=True):
            toks += out.outputs[0].token_ids
            text += out.outputs[0].text
            last = out
        return toks, text, last

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(6))))

    for (toks, text, last), r in zip(asyncio.run(main()), ref):
        assert toks == r.outputs[0].token_ids and text == r.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length"
    assert allm.loop_stats.steps > 0 and allm.num_in_flight == 0


def test_leaving_early_aborts_and_frees_blocks(allm):
    kv = allm.engine.core.kv_cache_manager
    start = kv.get_num_free_blocks()

    async def main() -> None:
        agen = allm.generate({"prompt_token_ids": prompts(3)[2]}, SamplingParams(max_tokens=200, ignore_eos=True),
                             "long", delta=True)
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(500):
            if allm.snapshot.num_running == 0 and kv.get_num_free_blocks() == start:
                return
            await asyncio.sleep(0.01)

    seen = []
    allm.observers.append(lambda rec: seen.append(rec.finish_reasons))
    asyncio.run(main())
    assert kv.get_num_free_blocks() == start and allm.snapshot.num_running == 0
    assert seen == [["abort"]]


def test_bad_requests_fail_before_queueing(allm):
    async def main() -> None:
        with pytest.raises(PromptTooLongError):
            allm.add_request({"prompt_token_ids": [1] * 300}, SamplingParams())
        with pytest.raises(InvalidRequestError):
            allm.add_request({"prompt_token_ids": [10 ** 6]}, SamplingParams())
        with pytest.raises(InvalidRequestError) as e:
            allm.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(logprobs=10 ** 3))
        assert e.value.param == "logprobs"

    asyncio.run(main())
    assert allm.num_in_flight == 0 and not allm.engine.has_unfinished_requests()


def _out(text: str, tokens: list[int], finish: str | None = None) -> RequestOutput:
    comp = CompletionOutput(0, text, tokens, None, None, finish_reason=finish)
    return RequestOutput("r", None, [1], None, [comp], finished=finish is not None)


def test_delta_view_holds_back_a_possible_stop_string():
    s = RequestStream("r", SamplingParams(stop=["STOP!"]), 1)
    deltas = []
    for text, toks, finish in [("Hello S", [1, 2], None), ("Hello STO", [1, 2, 3], None),
                               ("Hello", [1, 2, 3, 4], "stop")]:
        v = s.view(_out(text, toks, finish), delta=True)
        deltas.append(v.outputs[0].text if v and v.outputs else None)
    # "S" and "STO" might start "STOP!": held back; the final text drops them for good.
    assert "".join(d or "" for d in deltas) == "Hello"
    assert all("S" not in (d or "") for d in deltas)


def test_delta_view_reports_finish_once_and_skips_empty_news():
    s = RequestStream("r", SamplingParams(), 1)
    assert s.view(_out("a", [5]), delta=True).outputs[0].text == "a"
    assert s.view(_out("a", [5]), delta=True) is None  # nothing new
    last = s.view(_out("ab", [5, 6], "length"), delta=True)
    assert last.outputs[0].text == "b" and last.outputs[0].token_ids == [6]
    assert s.view(_out("ab", [5, 6], "length"), delta=True) is None
