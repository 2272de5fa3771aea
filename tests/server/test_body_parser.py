"""Large request bodies are validated in a helper process (body_parser.py): the event loop runs
while one is parsed (a thread would not do: pydantic-core holds the GIL), small ones parse on the
loop, a validation error from the helper is the same 400 naming the field, and the helper never
imports torch (it is a program of its own, not a multiprocessing child of the server's main module)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from body_models import Body

from vllite_core.entrypoints.openai.body_parser import BodyParser
from vllite_core.entrypoints.openai.serving_common import first_error

BIG = json.dumps({"prompt": list(range(300_000))}).encode()  # ~2 MiB: about 0.15 s of validation


@pytest.fixture(scope="module")
def parser():
    p = BodyParser()
    yield p
    p.close()


async def _parse_counting_loop_turns(parser: BodyParser, body: bytes):
    """(result, how many times the event loop ran another task while ``body`` was parsed)."""
    turns = 0
    done = False

    async def spin() -> None:
        nonlocal turns
        while not done:
            await asyncio.sleep(0)
            turns += 1

    spinner = asyncio.create_task(spin())
    await asyncio.sleep(0)
    turns = 0
    result = await parser.parse(body, Body)
    done = True
    await spinner
    return result, turns


def test_large_bodies_parse_in_a_helper_and_the_loop_runs_meanwhile(parser):
    (small, err), _ = asyncio.run(_parse_counting_loop_turns(parser, b'{"prompt": [1, 2]}'))
    assert err is None and small.pid == os.getpid() and small.prompt == [1, 2]
    (big, err), turns = asyncio.run(_parse_counting_loop_turns(parser, BIG))
    assert err is None and big.pid != os.getpid() and big.prompt == list(range(300_000))
    assert turns > 0  # the loop ran while the helper parsed
    on_loop = BodyParser(offload_bytes=0)  # the control: parsed on the loop, nothing else runs meanwhile
    (big, err), turns = asyncio.run(_parse_counting_loop_turns(on_loop, BIG))
    assert big.pid == os.getpid() and turns <= 1


def test_helper_errors_name_the_field(parser):
    bad = json.dumps({"prompt": list(range(300_000)), "max_tokens": "many"}).encode()
    (model, err), _ = asyncio.run(_parse_counting_loop_turns(parser, bad))
    assert model is None and err is not None
    api = first_error(err)
    assert api.status == 400 and api.param == "max_tokens", (api.message, err)
    (model, err), _ = asyncio.run(_parse_counting_loop_turns(parser, BIG[:-5]))
    assert first_error(err).code == "invalid_json"


# The server's main module, as `vllite serve` runs it (its CLI imports torch), then the parse helper:
# a multiprocessing child would import this main module again (and torch with it); the helper must not.
SERVER_LIKE_MAIN = """
import asyncio, json, os, sys
import vllite_core.entrypoints.cli
from body_models import Body
from vllite_core.entrypoints.openai.body_parser import BodyParser
from vllite_core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest
from vllite_core.entrypoints.openai.protocol_pooling import EmbeddingRequest, RerankRequest


async def main():
    parser = BodyParser(offload_bytes=1)  # every body goes to the helper
    try:
        req, _ = await parser.parse(json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode(), CompletionRequest)
        chat, _ = await parser.parse(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                                     .encode(), ChatCompletionRequest)
        emb, _ = await parser.parse(b'{"input": [[1, 2], [3]]}', EmbeddingRequest)
        rerank, _ = await parser.parse(b'{"query": "q", "documents": ["a", "b"]}', RerankRequest)
        lora, _ = await parser.parse(b'{"lora_name": "a", "lora_path": "/p"}', LoadLoRAAdapterRequest)
        body, _ = await parser.parse(b'{"prompt": [1]}', Body)
    finally:
        parser.close()
    print(json.dumps({"main_has_torch": "torch" in sys.modules, "helper_has_torch": body.torch_loaded,
                      "helper_pid": body.pid, "pid": os.getpid(), "prompt": req.prompt,
                      "messages": len(chat.messages), "others": [emb.input, rerank.documents, lora.lora_name]}))


if __name__ == "__main__":
    asyncio.run(main())
"""


def test_the_helper_imports_no_torch(tmp_path):
    """The helper validates the real request models (completion, chat, pooling, LoRA) without importing
    torch, even when the server's main module has."""
    script = tmp_path / "server_like_main.py"
    script.write_text(SERVER_LIKE_MAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["main_has_torch"] and r["helper_pid"] != r["pid"] and r["prompt"] == [1, 2, 3], r
    assert r["messages"] == 1 and r["others"] == [[[1, 2], [3]], ["a", "b"], "a"], r
    assert r["helper_has_torch"] is False, r
