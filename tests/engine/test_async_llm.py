"""AsyncLLM on a tiny random Llama: streamed outputs equal the sync engine's, aborts free the
KV blocks, bad requests fail before anything is queued; and the delta view never shows text
that a stop string will take back."""
from __future__ import annotations

import asyncio

import pytest

from vllite_core import LLM, SamplingParams
from vllite_core.config import EngineArgs
from vllite_core.engine.async_llm import AsyncLLM, RequestStream
from vllite_core.engine.core_client import multiprocessing_enabled
from vllite_core.engine.llm_engine import LLMEngine
from vllite_core.errors import InvalidRequestError, PromptTooLongError
from vllite_core.outputs import CompletionOutput, RequestOutput

ENGINE = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture
def allm(tiny_path):
    # In this process by default; VLLITE_ENABLE_V1_MULTIPROCESSING=1 runs the file against an engine-core process.
    args = EngineArgs.from_kwargs(model=tiny_path, scheduling_policy="priority", **ENGINE)
    a = AsyncLLM.from_engine_args(args, multiprocess=multiprocessing_enabled(default=False))
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


def test_output_kinds_stream_as_vllm_does(allm, tiny_path):
    """output_kind DELTA streams only what is new without delta=True, FINAL_ONLY yields the finished output
    alone; both add up to what the sync engine generates."""
    from vllite_core.sampling_params import RequestOutputKind

    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, output_kind=kind)

    p = prompts(2)[1]
    ref = LLM(model=tiny_path, **ENGINE).generate([{"prompt_token_ids": p}], params(RequestOutputKind.CUMULATIVE))[0]

    async def run(kind: RequestOutputKind) -> list[RequestOutput]:
        return [out async for out in allm.generate({"prompt_token_ids": p}, params(kind), f"k{kind.value}")]

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:  # one event loop: AsyncLLM binds to it
        return await run(RequestOutputKind.DELTA), await run(RequestOutputKind.FINAL_ONLY)

    deltas, final = asyncio.run(main())
    assert len(deltas) > 1 and [t for o in deltas for t in o.outputs[0].token_ids] == ref.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in deltas) == ref.outputs[0].text
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == ref.outputs[0].token_ids and final[0].outputs[0].text == ref.outputs[0].text


def test_leaving_early_aborts_and_frees_blocks(allm):
    core = allm.engine.core
    start = core.stats().num_free_blocks

    async def main() -> None:
        agen = allm.generate({"prompt_token_ids": prompts(3)[2]}, SamplingParams(max_tokens=200, ignore_eos=True),
                             "long", delta=True)
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(500):
            if allm.snapshot.num_running == 0 and core.stats().num_free_blocks == start:
                return
            await asyncio.sleep(0.01)

    seen = []
    allm.observers.append(lambda rec: seen.append(rec.finish_reasons))
    asyncio.run(main())
    assert core.stats().num_free_blocks == start and allm.snapshot.num_running == 0
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


def _record_salts(engine: LLMEngine) -> dict[str, str | None]:
    """request id -> the cache_salt of the Request the engine core was given (in this process, or the
    MPClient that sends it to an engine-core process)."""
    seen: dict[str, str | None] = {}
    sched = engine.core
    add = sched.add_request

    def recording(request):
        seen[request.request_id] = request.cache_salt
        add(request)

    sched.add_request = recording
    return seen


BAD_SALTS = ["", 5, ["a"]]


def test_cache_salt_reaches_the_request_offline(tiny_path):
    llm = LLM(model=tiny_path, **ENGINE)
    seen = _record_salts(llm.llm_engine)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt": "in the", "cache_salt": "tenant-a"},  # the tiny model's vocabulary: 512 tokens
                  {"prompt_token_ids": [5, 6, 7], "cache_salt": "tenant-b"},
                  {"prompt_token_ids": [5, 6, 7], "cache_salt": None}, "th"], sp)
    assert list(seen.values()) == ["tenant-a", "tenant-b", None, None]
    seen.clear()
    llm.generate({"prompt_token_ids": [5, 6, 7], "cache_salt": "s"}, SamplingParams(n=2, max_tokens=2))
    assert list(seen.values()) == ["s", "s"]  # every child of n > 1
    for bad in BAD_SALTS:
        with pytest.raises(InvalidRequestError) as e:
            llm.llm_engine.add_request(None, {"prompt": "in the", "cache_salt": bad}, sp)
        assert e.value.param == "cache_salt"
    assert not llm.llm_engine.has_unfinished_requests()


def test_cache_salt_isolates_the_prefix_cache_offline(tiny_path):
    """Same prompt, other salt: no hit; same salt: hits (and the engine's prefix-cache counters agree)."""
    llm = LLM(model=tiny_path, **ENGINE)
    prompt = list(range(1, 50))  # three full blocks of 16 tokens
    sp = SamplingParams(max_tokens=1, ignore_eos=True)

    def hits(salt: str | None) -> tuple[int, int]:
        before = llm.llm_engine.get_stats().prefix_cache_hits
        out = llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, sp)[0]
        return out.num_cached_tokens, llm.llm_engine.get_stats().prefix_cache_hits - before

    assert hits("tenant-a") == (0, 0)
    assert hits("tenant-a") == (48, 48)
    assert hits("tenant-b") == (0, 0)
    assert hits(None) == (0, 0)
    assert hits(None) == (48, 48)
    assert hits("tenant-b") == (48, 48)


def test_cache_salt_after_a_models_own_prompt_processing():
    from types import SimpleNamespace

    from vllite_core.inputs import ProcessedPrompt
    from vllite_core.model_interfaces import ModelCapabilities

    class OwnProcessing:  # like Whisper or BART: the model class turns the prompt into ids itself
        @classmethod
        def process_prompt(cls, prompt, ctx):
            return ProcessedPrompt(prompt_token_ids=[1, 2], prompt=prompt["prompt"], encoder_inputs=[3])

    caps = ModelCapabilities(processes_prompts=True)
    fake = SimpleNamespace(model_cls=OwnProcessing, input_context=None,
                           config=SimpleNamespace(model_config=SimpleNamespace(capabilities=caps)))
    got = LLMEngine.process_prompt(fake, {"prompt": "x", "cache_salt": "s"})
    assert got.cache_salt == "s" and got.encoder_inputs == [3]
    assert LLMEngine.process_prompt(fake, {"prompt": "x"}).cache_salt is None
    with pytest.raises(InvalidRequestError) as e:
        LLMEngine.process_prompt(fake, {"prompt": "x", "cache_salt": 3})
    assert e.value.param == "cache_salt"


def test_cache_salt_through_async_llm(allm):
    seen = _record_salts(allm.engine)

    async def main() -> None:
        for bad in BAD_SALTS:
            with pytest.raises(InvalidRequestError) as e:
                allm.add_request({"prompt_token_ids": [1, 2], "cache_salt": bad}, SamplingParams())
            assert e.value.param == "cache_salt"
        async for _ in allm.generate({"prompt_token_ids": [3, 4, 5], "cache_salt": "async"},
                                     SamplingParams(max_tokens=2, ignore_eos=True), "a1"):
            pass

    asyncio.run(main())
    assert seen == {"a1": "async"} and allm.num_in_flight == 0


def test_cache_salt_through_the_server(allm):
    from fastapi.testclient import TestClient

    from vllite_core.entrypoints.openai.api_server import build_app

    seen = _record_salts(allm.engine)
    with TestClient(build_app(allm, ["tiny"], trust_request_chat_template=True)) as client:
        chat = [{"role": "user", "content": "in the"}]
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # ids within the tiny vocabulary
        bodies = [("/v1/completions", {"prompt": "in the", "max_tokens": 2, "cache_salt": "c1"}),
                  ("/v1/completions", {"prompt": [[3, 4], [5, 6]], "max_tokens": 2, "cache_salt": "c2"}),
                  ("/v1/completions", {"prompt": "in the", "max_tokens": 2, "cache_salt": "c3", "stream": True}),
                  ("/v1/chat/completions", {"messages": chat, "max_tokens": 2, "cache_salt": "c4",
                                            "chat_template": template}),
                  ("/v1/completions", {"prompt": "in the", "max_tokens": 2})]
        for path, body in bodies:
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
        assert sorted(seen.values(), key=str) == [None, "c1", "c2", "c2", "c3", "c4"]
        for path, body in bodies[:4]:
            for bad in BAD_SALTS:
                r = client.post(path, json={**body, "cache_salt": bad})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "cache_salt"
    assert allm.num_in_flight == 0


def test_sync_delta_stream_matches_the_final_output(tiny_path):
    """LLMEngine.step(delta=True) streams through the same DeltaCursor: with n > 1 and a stop string,
    each completion's deltas concatenate to its final text and it is reported finished once."""
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=tiny_path, **ENGINE))
    ref = LLM.from_engine(engine)
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=1,
                        prompt_logprobs=1)
    final = ref.generate({"prompt_token_ids": [5, 6, 7, 8]}, sp)[0]
    # A stop string that really occurs: a piece of completion 1's text.
    text1 = final.outputs[1].text
    stop = text1[len(text1) // 2:len(text1) // 2 + 3] if len(text1) >= 6 else "\u2603\u2603"
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=1,
                        prompt_logprobs=1, stop=[stop])
    final = ref.generate({"prompt_token_ids": [5, 6, 7, 8]}, sp)[0]
    engine.add_request("d", {"prompt_token_ids": [5, 6, 7, 8]}, sp)
    texts, toks, lps, finishes, prompt_lps = {}, {}, {}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step(delta=True):
            assert out.outputs or out.prompt_logprobs is not None
            prompt_lps += out.prompt_logprobs is not None
            for c in out.outputs:
                assert c.text or c.token_ids or c.finish_reason
                texts[c.index] = texts.get(c.index, "") + c.text
                toks[c.index] = toks.get(c.index, []) + c.token_ids
                lps[c.index] = lps.get(c.index, []) + c.logprobs
                if c.finish_reason is not None:
                    finishes[c.index] = finishes.get(c.index, 0) + 1
                if stop:
                    assert stop not in texts[c.index]
    assert prompt_lps == 1 and finishes == {0: 1, 1: 1, 2: 1}
    for c in final.outputs:
        assert texts[c.index] == c.text and toks[c.index] == c.token_ids and lps[c.index] == c.logprobs
    assert final.outputs[1].finish_reason == "stop" or len(text1) < 6


def test_a_reader_away_gets_coalesced_news_and_the_stop_error_next(allm):
    """The server's stream merge (serving_common.merged) while its client reads slowly: what was generated
    meanwhile comes as one delta (outputs coalesce in the request's stream, as vLLM's output collector does,
    instead of queueing one per step), and when the server stops waiting (shutdown's drain over) the error
    comes next, not behind a backlog. Waits on the engine's state, not on time."""
    from vllite_core.entrypoints.openai.errors import APIError
    from vllite_core.entrypoints.openai.serving_common import _Limits, _merged

    async def away_until(stream: RequestStream, tokens: int) -> None:
        while stream.num_tokens_seen < tokens and not stream.finished:
            await asyncio.sleep(0.005)

    async def main() -> tuple[list[RequestOutput], int, APIError]:
        stop = asyncio.Event()
        limits = _Limits(None, None, stop, None, {})  # type: ignore[arg-type]  # the state is not read here
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        stream = allm.add_request({"prompt_token_ids": prompts(2)[1]}, params, "slow-reader")
        merge = _merged(allm, [stream], True, limits)
        outs = [(await anext(merge))[1]]
        await away_until(stream, 40)
        outs += [out async for _, out in merge]

        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = allm.add_request({"prompt_token_ids": prompts(2)[1]}, params, "stopped")
        merge = _merged(allm, [stream], True, limits)
        await anext(merge)
        await away_until(stream, 20)
        stop.set()
        with pytest.raises(APIError) as e:
            await anext(merge)
        return outs, stream.num_tokens_seen, e.value

    outs, seen, err = asyncio.run(main())
    assert len(outs) == 2 and sum(len(o.outputs[0].token_ids) for o in outs) == 40 and outs[-1].finished
    assert 20 <= seen < 200 and err.status == 503 and err.code == "server_shutting_down"
    assert allm.num_in_flight == 0  # the stopped request was aborted
