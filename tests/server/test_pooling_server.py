"""The pooling endpoints on a real server (tests/server_harness.py): the real ``openai`` client's
embeddings.create (float and base64) against sentence-transformers on all-MiniLM-L6-v2, /score and
/rerank with embeddings and with a tiny BERT cross-encoder against transformers, and the refusals."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from server_harness import ServerProcess
from tiny_pooling import minilm_path, save_bert_cross_encoder

SENTENCES = ["The cat sits on the mat.", "Le chat est assis sur le tapis.", "Stock markets fell sharply today.",
             "a", "Die Katze sitzt auf der Matte, und sie schläft."]
ENGINE = ["--dtype", "float32", "--num-threads", "2"]


@pytest.fixture(scope="module")
def minilm_server():
    srv = ServerProcess(["--model", minilm_path(), *ENGINE])
    yield srv.wait_ready()
    srv.stop()


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path(), device="cpu")


def test_openai_embeddings_float_and_base64(minilm_server, st_model):
    import openai

    client = openai.OpenAI(base_url=minilm_server + "/v1", api_key="none")
    ref = st_model.encode(SENTENCES, convert_to_numpy=True)
    got = client.embeddings.create(model=minilm_path(), input=SENTENCES, encoding_format="float")
    floats = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert [d.index for d in got.data] == list(range(len(SENTENCES)))
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(SENTENCES)
    # Asked for base64, the client hands back the strings: little-endian float32.
    b64 = client.embeddings.create(model=minilm_path(), input=SENTENCES, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data])
    # Unasked, the client requests base64 itself and decodes it into floats.
    default = np.array([d.embedding for d in client.embeddings.create(model=minilm_path(), input=SENTENCES).data],
                       dtype=np.float32)
    for mine in (floats, decoded, default):
        cos = (mine * ref).sum(1) / np.linalg.norm(mine, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() >= 0.99999 and np.abs(mine - ref).max() <= 1e-5
    assert np.array_equal(floats, decoded) and np.array_equal(floats, default)
    # Token ids are an input too.
    ids = st_model.tokenizer(SENTENCES[0])["input_ids"]
    one = client.embeddings.create(model=minilm_path(), input=[ids]).data[0].embedding
    assert np.abs(np.array(one) - ref[0]).max() <= 1e-5


def test_sagemaker_invocations_route_pooling_bodies_by_shape(minilm_server, st_model):
    """/invocations (SageMaker's one route) answers an ``input`` body as embeddings and a ``query`` /
    ``documents`` body as a rerank, as vLLM routes them."""
    ref = st_model.encode(SENTENCES, convert_to_numpy=True)
    via = httpx.post(minilm_server + "/invocations", json={"input": SENTENCES}, timeout=60).json()
    assert via["object"] == "list" and [d["object"] for d in via["data"]] == ["embedding"] * len(SENTENCES)
    assert np.abs(np.array([d["embedding"] for d in via["data"]]) - ref).max() <= 1e-5
    body = {"query": "A cat on a mat", "documents": SENTENCES}
    via = httpx.post(minilm_server + "/invocations", json=body, timeout=60).json()
    assert via["results"] == httpx.post(minilm_server + "/rerank", json=body, timeout=60).json()["results"]


def test_embedding_refusals(minilm_server):
    cases = [("/v1/embeddings", {"input": []}, "input"), ("/v1/embeddings", {"input": ""}, "input"),
             ("/v1/embeddings", {"input": "hi", "dimensions": 64}, "dimensions"),
             ("/v1/embeddings", {"input": [[101] * 400]}, "input"),
             ("/classify", {"input": "hi"}, "task"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "model"),
             ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
             ("/v1/embeddings", {"input": [101, 30522, 102]}, "prompt_token_ids"),
             ("/v1/embeddings", {"input": [101, 2 ** 40, 102]}, "prompt_token_ids"),
             ("/v1/embeddings", {"input": [101, -1]}, "prompt_token_ids"),
             ("/v1/embeddings", {"input": [[]]}, "input"), ("/v1/embeddings", {"input": 5}, "input"),
             ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
             ("/rerank", {"query": "q", "documents": []}, "documents"),
             ("/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
             ("/score", {"text_1": [], "text_2": "d"}, "text_1"),
             ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2")]
    for path, body, param in cases:
        r = httpx.post(minilm_server + path, json=body, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.text)
    r = httpx.post(minilm_server + "/v1/embeddings", json={"input": "hi", "truncate_prompt_tokens": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1


def test_score_and_rerank_with_embeddings(minilm_server, st_model):
    from sentence_transformers.util import cos_sim

    query, docs = "A cat on a mat", SENTENCES
    emb = st_model.encode([query] + docs, convert_to_tensor=True)
    ref = cos_sim(emb[:1], emb[1:])[0].tolist()
    r = httpx.post(minilm_server + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["score"] for d in r["data"]] == pytest.approx(ref, abs=1e-5)
    r = httpx.post(minilm_server + "/rerank", json={"query": query, "documents": docs, "top_n": 3}, timeout=60)
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(docs)), key=lambda i: -ref[i])[:3]
    assert results[0]["document"]["text"] == docs[results[0]["index"]]
    pooled = httpx.post(minilm_server + "/pooling", json={"input": docs[:2]}, timeout=60).json()
    assert np.abs(np.array(pooled["data"][0]["data"]) - emb[1].numpy()).max() <= 1e-5


def test_pooling_route_serves_per_token_embeddings(minilm_server, st_model):
    """vLLM's ``task`` on /pooling: token_embed gives one normalised row per prompt token (the encoder's
    token states as sentence-transformers returns them, each normalised as an embedding is)."""
    ref = st_model.encode(SENTENCES[:2], output_value="token_embeddings")
    r = httpx.post(minilm_server + "/pooling", json={"input": SENTENCES[:2], "task": "token_embed"}, timeout=60)
    assert r.status_code == 200, r.text
    for d, tokens in zip(r.json()["data"], ref):
        rows = np.array(d["data"], dtype=np.float32)
        want = torch.nn.functional.normalize(tokens, dim=-1).numpy()
        assert rows.shape == want.shape and np.abs(rows - want).max() <= 1e-5
    r = httpx.post(minilm_server + "/pooling", json={"input": "hi", "task": "sing"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bert-ce-server")
    model = save_bert_cross_encoder(path, seed=5)
    srv = ServerProcess(["--model", str(path), *ENGINE])
    yield srv.wait_ready(), str(path), model
    srv.stop()


@pytest.mark.slow  # a second server start
def test_rerank_with_cross_encoder(cross_encoder):
    from transformers import AutoTokenizer

    url, path, model = cross_encoder
    tok = AutoTokenizer.from_pretrained(path)
    query = "which animal sits on the mat?"
    docs = [s.lower() for s in SENTENCES]
    with torch.no_grad():
        ref = torch.cat([model(**tok(query, d, return_tensors="pt")).logits for d in docs])[:, 0].sigmoid().tolist()
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(url + route, json={"query": query, "documents": docs}, timeout=60).json()
        assert [x["index"] for x in r["results"]] == sorted(range(len(docs)), key=lambda i: -ref[i])
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx(sorted(ref, reverse=True), abs=1e-5)
    r = httpx.post(url + "/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["score"] for d in r["data"]] == pytest.approx(ref, abs=1e-5)
    probs = httpx.post(url + "/classify", json={"input": [docs[0]]}, timeout=60).json()["data"][0]
    assert probs["num_classes"] == 1
    # A classifier serves no embeddings.
    r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"
    r = httpx.post(url + "/pooling", json={"input": "hi", "encoding_format": "base64"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"


@pytest.mark.slow  # a server start
def test_qwen3_reranker_through_hf_overrides_on_the_server(tmp_path):
    """``--hf-overrides`` as vLLM takes it for an original Qwen3-Reranker (untied LM head here): /score and
    /rerank give HF's softmax over the "no" / "yes" logits at each prompt's last token."""
    import json

    from tiny_pooling import QWEN3_RERANKER_OVERRIDES, qwen3_reranker_reference, rerank_texts, save_qwen3_reranker

    model = save_qwen3_reranker(tmp_path, tied=False, seed=12)
    query, docs = rerank_texts("which animal sits on the mat?", [s.lower() for s in SENTENCES])
    ref = qwen3_reranker_reference(model, tmp_path, query, docs)
    srv = ServerProcess(["--model", str(tmp_path), *ENGINE, "--runner", "pooling",
                         "--hf-overrides", json.dumps(QWEN3_RERANKER_OVERRIDES)])
    try:
        url = srv.wait_ready()
        r = httpx.post(url + "/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
        assert [d["score"] for d in r["data"]] == pytest.approx(ref, abs=1e-5)
        r = httpx.post(url + "/rerank", json={"query": query, "documents": docs}, timeout=60).json()
        assert [x["index"] for x in r["results"]] == sorted(range(len(docs)), key=lambda i: -ref[i])
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx(sorted(ref, reverse=True), abs=1e-5)
    finally:
        srv.stop()
