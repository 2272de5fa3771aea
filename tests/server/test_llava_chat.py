"""Images in chat: ``image_url`` parts (data URLs; http(s) only from allowed domains) through ``LLM.chat`` and
through ``vllite serve`` with the real ``openai`` client, against Hugging Face greedy tokens on a tiny random
Llava; the bad-input table answers 400 naming the field and the server keeps serving."""
from __future__ import annotations

import base64
import functools
import http.server
import io
import threading
import time

import httpx
import openai
import pytest
from server_harness import ServerProcess
from tiny_bart import make_image
from tiny_llava import hf_llava_greedy, llava_processor, save_tiny_llava

from vllite_core import LLM, SamplingParams
from vllite_core.errors import InvalidRequestError

pytestmark = pytest.mark.slow
N = 6


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


def image_msg(text: str, urls: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava-chat")
    hf = save_tiny_llava(path)
    return str(path), hf, llava_processor(path)


@pytest.fixture(scope="module")
def media_server(tmp_path_factory):
    """A local http.server on 127.0.0.1 serving two pictures."""
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(png(make_image(45, 35, 7)))
    (root / "big.png").write_bytes(png(make_image(300, 300, 8)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _hf_chat(llava, text: str, images) -> tuple[list[int], list[int]]:
    """HF reference: the template rendered with the processor's ``<image>`` text, then LlavaProcessor + generate."""
    _, hf, proc = llava
    content = "\n".join(["<image>"] * len(images) + [text])
    prompt = proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
    ids = proc(text=prompt, images=images, return_tensors="pt")["input_ids"][0].tolist()
    return ids, hf_llava_greedy(hf, proc, prompt, images, N)


def test_llm_chat_image_url_matches_hf(llava, tiny_path):
    path, _, _ = llava
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64)
    a, b = make_image(40, 30, 0), make_image(70, 50, 1)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    convs = [image_msg("What is this?", [data_url(a)]), image_msg("Compare them.", [data_url(a), data_url(b)]),
             [{"role": "user", "content": [{"type": "image_pil", "image_pil": b}, {"type": "text", "text": "Hi"}]}]]
    refs = [_hf_chat(llava, "What is this?", [a]), _hf_chat(llava, "Compare them.", [a, b]),
            _hf_chat(llava, "Hi", [b])]
    outs = llm.chat(convs, params)
    assert [o.prompt_token_ids for o in outs] == [r[0] for r in refs]
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    with pytest.raises(InvalidRequestError, match="http"):
        llm.chat(image_msg("x", ["http://127.0.0.1:9/a.png"]), params)
    text_llm = LLM(model=tiny_path, dtype="float32", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="text-only") as e:
        text_llm.chat(image_msg("x", [data_url(a)]), params)
    assert e.value.param == "messages.content"


@pytest.fixture(scope="module")
def server(llava):
    path, _, _ = llava
    srv = ServerProcess(["--model", path, "--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1",
                         "--limit-mm-per-prompt", "image=2", "--max-image-pixels", "40000",
                         "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "5"])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_server_chat_images_and_bad_input(llava, server, media_server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    tok = llava[2].tokenizer

    def chat(messages):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0.0,
                                              extra_body={"ignore_eos": True})

    a, b = make_image(40, 30, 0), make_image(70, 50, 1)
    for text, images in [("What is this?", [a]), ("Compare them.", [a, b])]:
        ids, ref = _hf_chat(llava, text, images)
        resp = chat(image_msg(text, [data_url(im) for im in images]))
        assert resp.choices[0].message.content == tok.decode(ref)
        assert resp.usage.prompt_tokens == len(ids)
    # An allowed http URL gives what its bytes as a data URL give.
    fetched = make_image(45, 35, 7)
    want = chat(image_msg("Describe.", [data_url(fetched)])).choices[0].message.content
    assert chat(image_msg("Describe.", [media_server + "/a.png"])).choices[0].message.content == want

    bad = [
        (image_msg("x", ["data:image/png;base64," + base64.b64encode(b"not a png").decode()]),
         "messages.content.image_url", "cannot decode"),
        (image_msg("x", ["data:image/png;base64,@@@"]), "messages.content.image_url", "base64"),
        (image_msg("x", [data_url(a)] * 3), "messages.content", "limit_mm_per_prompt"),
        (image_msg("x", [data_url(make_image(300, 200, 2))]), "messages.content.image_url", "max_image_pixels"),
        (image_msg("x", [media_server + "/big.png"]), "messages.content.image_url", "max_image_pixels"),
        (image_msg("x", ["http://localhost:9/a.png"]), "messages.content.image_url", "allowed-media-domains"),
        (image_msg("x", [media_server + "/missing.png"]), "messages.content.image_url", "HTTP 404"),
        (image_msg("x", ["ftp://127.0.0.1/a.png"]), "messages.content.image_url", "scheme"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
         "messages", ""),
    ]
    for messages, param, msg in bad:
        r = httpx.post(server + "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] is not None and err["param"].startswith(param), (param, err)
        assert msg in err["message"], (msg, err)
    # The server still serves, streaming too.
    want = tok.decode(_hf_chat(llava, "What is this?", [a])[1])
    assert chat(image_msg("What is this?", [data_url(a)])).choices[0].message.content == want
    stream = client.chat.completions.create(model=model, messages=image_msg("What is this?", [data_url(a)]),
                                            max_tokens=N, temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def _mm_counters(server: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server + "/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith(("vllm:mm_cache_", "vllite:mm_cache_"))}


def test_server_metrics_count_encoder_cache(server):
    """The same data-URL image twice (other text, so its placeholders are recomputed): two encoder-cache
    queries, the second a hit, in /metrics under vLLM's names (counted in the engine-core process)."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    before = _mm_counters(server)
    url = data_url(make_image(52, 41, 90))  # an image no other test sends
    for text in ("What is this?", "Describe the colours."):
        client.chat.completions.create(model=model, messages=image_msg(text, [url]), max_tokens=2)
    deadline = time.monotonic() + 30
    while True:  # the engine's numbers reach the API process with its next outputs
        after = _mm_counters(server)
        delta = {k: after[k] - before[k] for k in after}
        if delta["vllm:mm_cache_queries_total"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta["vllm:mm_cache_queries_total"] == delta["vllite:mm_cache_queries_total"] == 2
    assert delta["vllm:mm_cache_hits_total"] == delta["vllite:mm_cache_hits_total"] == 1
    assert delta["vllite:mm_cache_evictions_total"] == 0  # room for both (evictions: tests/models/test_llava.py)


def test_cli_generate_image(llava, tmp_path):
    """``vllite generate --image PATH``: plain prompt with a placeholder, and --chat-template; HF tokens."""
    import json
    import os
    import subprocess
    import sys

    path, _, _ = llava
    img = make_image(40, 30, 0)
    (tmp_path / "a.png").write_bytes(png(img))
    out = tmp_path / "out.jsonl"
    prompt = "USER: <image>\nWhat is this? ASSISTANT:"
    env = dict(os.environ, VLLITE_LOG_LEVEL="WARNING")
    base = [sys.executable, "-m", "vllite_core.entrypoints.cli", "generate", "--model", path, "--dtype", "float32",
            "--num-kv-blocks", "32", "--image", str(tmp_path / "a.png"), "--max-tokens", str(N), "--ignore-eos",
            "--output", str(out)]
    proc = subprocess.run(base + [prompt], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _, hf, proc_ = llava
    assert json.loads(out.read_text())["token_ids"] == hf_llava_greedy(hf, proc_, prompt, [img], N)
    proc = subprocess.run(base + ["--chat-template", "What is this?"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["token_ids"] == _hf_chat(llava, "What is this?", [img])[1]
    proc = subprocess.run(base + ["--image", str(tmp_path / "missing.png"), prompt], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "missing.png" in proc.stderr


def test_cli_chat_image(llava, tmp_path):
    """``vllite chat --image PATH``: the first message carries the image; the streamed reply is HF's."""
    import os
    import subprocess
    import sys

    path, _, proc_ = llava
    img = make_image(40, 30, 0)
    (tmp_path / "a.png").write_bytes(png(img))
    env = dict(os.environ, VLLITE_LOG_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "vllite_core.entrypoints.cli", "chat", "--model", path, "--dtype", "float32",
           "--num-kv-blocks", "32", "--image", str(tmp_path / "a.png"), "--max-tokens", str(N), "--ignore-eos"]
    proc = subprocess.run(cmd, input="What is this?\n", capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    want = proc_.tokenizer.decode(_hf_chat(llava, "What is this?", [img])[1])
    assert proc.stdout.removeprefix("> ").splitlines()[0] == want


def _input_image(text: str, urls: list[str], detail: str | None = None) -> list[dict]:
    parts = [{"type": "input_image", "image_url": u, **({"detail": detail} if detail else {})} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "input_text", "text": text}]}]


def test_responses_input_image(llava, server, media_server):
    """``input_image`` parts of /v1/responses take chat's multimodal path: through the real openai client,
    the prompt's token count is HF's (placeholders expanded by LlavaProcessor), the text equals chat's for the
    same image and prompt (greedy), a different image gives a different text, an allowed http URL equals its
    bytes as a data URL, streamed equals whole; bad parts are 400s naming input's field."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    greedy = {"max_output_tokens": N, "temperature": 0.0}

    def respond(text: str, urls: list[str], **kw):
        return client.responses.create(model=model, input=_input_image(text, urls, **kw), **greedy)

    def chat_text(text: str, urls: list[str]) -> str:
        return client.chat.completions.create(model=model, messages=image_msg(text, urls), max_tokens=N,
                                              temperature=0.0).choices[0].message.content

    a, b = make_image(40, 30, 0), make_image(70, 50, 1)
    seen = set()
    for text, images in [("What is this?", [a]), ("What is this?", [b]), ("Compare them.", [a, b])]:
        urls = [data_url(im) for im in images]
        resp = respond(text, urls, detail="low")
        assert resp.usage.input_tokens == len(_hf_chat(llava, text, images)[0])
        assert resp.output_text == chat_text(text, urls)
        seen.add(resp.output_text)
    assert len(seen) == 3  # the pictures reach the model: each gives its own greedy text
    fetched = make_image(45, 35, 7)
    assert respond("Describe.", [media_server + "/a.png"]).output_text == respond(
        "Describe.", [data_url(fetched)]).output_text
    events = client.responses.create(model=model, input=_input_image("What is this?", [data_url(a)]), stream=True,
                                     **greedy)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == chat_text("What is this?", [data_url(a)])

    bad = [
        ([{"type": "input_image", "file_id": "file-1"}], "input[0].content[0].file_id", "uploaded files"),
        ([{"type": "input_image"}], "input[0].content[0].image_url", "URL string"),
        ([{"type": "input_image", "image_url": data_url(a), "detail": "huge"}], "input[0].content[0].detail",
         "detail"),
        ([{"type": "input_image", "image_url": "data:image/png;base64,@@@"}], "input.content.image_url", "base64"),
        ([{"type": "input_image", "image_url": "http://localhost:9/a.png"}], "input.content.image_url",
         "allowed-media-domains"),
        ([{"type": "input_file", "file_data": "x"}], "input[0].content[0]", "input_file"),
    ]
    for content, param, msg in bad:
        r = httpx.post(server + "/v1/responses", json={"model": model, "input": [{"role": "user", "content": content}],
                                                      "max_output_tokens": 2}, timeout=60)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param or (err["param"] or "").startswith(param), (param, err)
        assert msg in err["message"], (msg, err)
    r = httpx.post(server + "/v1/responses", json={"model": model, "max_output_tokens": 2, "input": [
        {"role": "assistant", "content": [{"type": "input_image", "image_url": data_url(a)}]}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]", r.text


def test_anthropic_count_tokens_counts_images(llava, server):
    """/v1/messages/count_tokens with image blocks counts the image's expanded placeholder tokens: equal to
    the Messages endpoint's own usage.input_tokens for the same request, and to HF's processor."""
    import anthropic

    claude = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0)
    model = openai.OpenAI(base_url=server + "/v1", api_key="none").models.list().data[0].id
    a, b = make_image(40, 30, 0), make_image(70, 50, 1)

    def block(img) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(png(img)).decode()}}

    for text, images in [("What is this?", [a]), ("Compare them.", [a, b])]:
        messages = [{"role": "user", "content": [block(im) for im in images] + [{"type": "text", "text": text}]}]
        counted = claude.messages.count_tokens(model=model, messages=messages).input_tokens
        used = claude.messages.create(model=model, max_tokens=1, messages=messages).usage.input_tokens
        assert counted == used == len(_hf_chat(llava, text, images)[0])
    claude.close()
