"""Issue 58, rows 1-2 (in-process): a request's own chat template is refused unless the server
trusts them (vLLM's --trust-request-chat-template); the template sandbox's budget and error
mapping. The attacks against a real server: test_reliability_server.py."""
from __future__ import annotations

import asyncio
import time

import httpx

from vllite_core.entrypoints.openai.template_sandbox import TemplateLimits, TemplateSandbox, render_job

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # ids within the tiny vocabulary
CHAT = [{"role": "user", "content": "in the"}]
HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_request_template_refused_without_trust(tiny_path):
    """In-process app without the flag: 400 naming chat_template (also inside chat_template_kwargs);
    the server's own template still renders."""
    from vllite_core.config import EngineArgs
    from vllite_core.engine.async_llm import AsyncLLM
    from vllite_core.engine.llm_engine import LLMEngine
    from vllite_core.entrypoints.openai.api_server import build_app

    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=tiny_path, dtype="float32", num_kv_blocks=32))
    allm = AsyncLLM(engine)
    app = build_app(allm, ["tiny"], chat_template=TEMPLATE)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            body = {"messages": CHAT, "max_tokens": 1}
            return [await c.post("/v1/chat/completions", json={**body, "chat_template": TEMPLATE}),
                    await c.post("/v1/chat/completions",
                                 json={**body, "chat_template_kwargs": {"chat_template": HANG}}),
                    await c.post("/v1/chat/completions", json=body)]

    try:
        own, in_kwargs, served = asyncio.run(main())
    finally:
        app.state.vllite.templates.close()
        allm.close()
    for r in (own, in_kwargs):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    assert served.status_code == 200, served.text


def test_sandbox_budget_counts_render_time_and_recovers():
    """The sandbox alone (no server): a render past its budget is a 400 and the same worker serves
    the next render; a render that raises names the messages, a request template's syntax error
    names chat_template."""
    class Tok:
        special_tokens_map = {"bos_token": "<s>"}

        def get_chat_template(self, template, tools):
            return template

    sb = TemplateSandbox(TemplateLimits(timeout_s=0.5, workers=1))

    async def run(template: str, request: bool = True):
        job = render_job(Tok(), CHAT, True, False, template, None, request)
        try:
            return await sb.render(job)
        except Exception as e:  # APIError
            return e

    try:
        assert asyncio.run(run("{{ bos_token }}" + TEMPLATE)) == "<s>in the"
        t0 = time.monotonic()
        e = asyncio.run(run(HANG))
        assert e.status == 400 and e.param == "chat_template" and time.monotonic() - t0 < 60
        assert asyncio.run(run(TEMPLATE)) == "in the"
        e = asyncio.run(run("{% if"))
        assert e.status == 400 and e.param == "chat_template"
        e = asyncio.run(run("{{ raise_exception('bad order') }}"))
        assert e.status == 400 and e.param == "messages" and "bad order" in e.message
        e = asyncio.run(run("{{ ''.__class__.__mro__ }}"))
        assert e.code == "unsafe_chat_template"
    finally:
        sb.close()


def test_sandbox_renders_what_apply_chat_template_renders():
    """The reference: the tokenizer's own apply_chat_template on the same messages (SmolLM2's
    template, with a generation prompt, continuing a final message, and with tools)."""
    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hel"}]
    cases = [(msgs[:2], dict(add_generation_prompt=True)), (msgs, dict(continue_final_message=True)),
             (msgs[:2], dict(add_generation_prompt=True, tools=tools))]
    sb = TemplateSandbox(TemplateLimits(workers=1))
    try:
        for convo, kw in cases:
            want = tok.apply_chat_template(convo, tokenize=False, **kw)
            extra = {"tools": kw["tools"]} if "tools" in kw else None
            job = render_job(tok, convo, kw.get("add_generation_prompt", False),
                             kw.get("continue_final_message", False), None, extra, False)
            assert asyncio.run(sb.render(job)) == want
    finally:
        sb.close()
