"""Large request bodies are validated in a helper process (body_parser.py): the event loop runs
while one is parsed (a thread would not do: pydantic-core holds the GIL), small ones parse on the
loop, and a validation error from the helper is the same 400 naming the field."""
from __future__ import annotations

import asyncio
import json
import os

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
