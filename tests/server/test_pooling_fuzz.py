"""Schemathesis against the pooling routes of the server's own OpenAPI schema, in process on a tiny random BERT
cross-encoder (all-MiniLM-L6-v2's tokenizer, 128 positions): a bounded, seeded run of valid and invalid bodies
over /v1/embeddings, /pooling, /classify, /score, /v1/score, /rerank, /v1/rerank and /v2/rerank. No case may get
a 5xx (a classifier's /v1/embeddings is a 400 naming the task, so the body checks still run), and afterwards
the engine still scores and every KV block is free."""
from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from test_server_fuzz import _post, _total_blocks
from tiny_pooling import save_bert_cross_encoder

from vllite_core.config import EngineArgs
from vllite_core.engine.async_llm import AsyncLLM
from vllite_core.engine.llm_engine import LLMEngine
from vllite_core.entrypoints.openai.api_server import build_app

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation import GenerationMode  # noqa: E402

ROUTES = {"/v1/embeddings": "EmbeddingRequest", "/pooling": "PoolingRequest", "/classify": "ClassificationRequest",
          "/score": "ScoreRequest", "/v1/score": "ScoreRequest", "/rerank": "RerankRequest",
          "/v1/rerank": "RerankRequest", "/v2/rerank": "RerankRequest"}
CASES = 15  # per route and mode: 8 routes x 2 modes x 15 = 240 cases


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bert-ce-fuzz")
    save_bert_cross_encoder(path, seed=3)
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=str(path), dtype="float32",
                                                               max_num_batched_tokens=256))
    allm = AsyncLLM(engine)
    with TestClient(build_app(allm, ["tiny"]), raise_server_exceptions=False) as client:
        yield client, allm
    allm.close()


def test_schema_lists_pooling_routes_with_request_bodies(served):
    client, _ = served
    schema = client.get("/openapi.json").json()
    for path, model in ROUTES.items():
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}, path
        assert schema["components"]["schemas"][model]["properties"], model


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", list(ROUTES))
def test_schemathesis_pooling_cases_get_no_5xx(served, path, mode):
    client, allm = served
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)
    statuses: dict[int, int] = {}

    @hypothesis_seed(4321)
    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        status = _post(client, path, case.body if case.body is not None else {})
        statuses[status] = statuses.get(status, 0) + 1

    run()
    print(path, mode, "status counts:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= CASES // 2, statuses
    deadline = time.monotonic() + 20
    while (allm.num_in_flight or allm.engine.has_unfinished_requests()) and time.monotonic() < deadline:
        time.sleep(0.05)
    _total_blocks(client)


def test_engine_scores_after_fuzzing(served):
    client, _ = served
    r = client.post("/score", json={"text_1": "a cat", "text_2": ["a mat", "a dog"]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text
    _total_blocks(client)
