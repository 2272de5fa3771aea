"""XLM-RoBERTa / RoBERTa (bge-m3 embeddings, bge-reranker cross-encoders) and ModernBERT against transformers on tiny
random checkpoints: CLS embeddings, pair scores from the RoBERTa pair layout, and the context length left after
the position offset."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_pooling import save_xlm_roberta

from vllite_core import LLM, PoolingParams

TEXTS = ["what is the capital of france?", "paris is the capital of france.",
         "bananas are yellow and rich in potassium.", "the eiffel tower is in paris " * 4]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-xlmr")
    return str(path), save_xlm_roberta(path, head=False)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-xlmr-ce")
    return str(path), save_xlm_roberta(path, head=True, seed=4)


def test_xlm_roberta_embeddings_match_transformers(encoder):
    from transformers import AutoTokenizer

    path, model = encoder
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, dtype="float32")
    assert llm.llm_engine.max_model_len == 66 - (0 + 1)  # positions start after the padding index (0)
    outs = llm.embed(TEXTS)
    with torch.no_grad():
        ref = torch.cat([model(**tok(t, return_tensors="pt")).last_hidden_state[:, 0] for t in TEXTS])
    got = torch.stack([torch.as_tensor(o.outputs.embedding) for o in outs])
    assert (got - F.normalize(ref, dim=-1)).abs().max() <= 1e-5
    raw = llm.embed(TEXTS[:1], PoolingParams(normalize=False))[0]
    assert (torch.as_tensor(raw.outputs.embedding) - ref[0]).abs().max() <= 1e-5


def test_xlm_roberta_cross_encoder_scores_match_transformers(reranker):
    from transformers import AutoTokenizer

    path, model = reranker
    tok = AutoTokenizer.from_pretrained(path)
    pairs = [(TEXTS[0], t) for t in TEXTS[1:]]
    with torch.no_grad():
        ref = torch.cat([model(**tok(a, b, return_tensors="pt")).logits for a, b in pairs])[:, 0]
    llm = LLM(path, dtype="float32")
    scores = torch.tensor([o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:])])
    assert (scores - ref.sigmoid()).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    from tiny_pooling import save_modernbert

    enc, ce = tmp_path_factory.mktemp("tiny-mbert"), tmp_path_factory.mktemp("tiny-mbert-ce")
    return (str(enc), save_modernbert(enc, head=False)), (str(ce), save_modernbert(ce, head=True, seed=6))


def test_modernbert_embeddings_and_scores_match_transformers(modernbert):
    """Local layers' windows are crossed (prompts of 12+ tokens, an 8-token window); mean-pooled head."""
    from transformers import AutoTokenizer

    (enc_path, enc), (ce_path, ce) = modernbert
    tok = AutoTokenizer.from_pretrained(enc_path)
    texts = [t + " , as the old guide to the city says" for t in TEXTS]
    assert all(len(tok(t).input_ids) > 10 for t in texts)
    with torch.no_grad():
        ref = torch.cat([enc(**tok(t, return_tensors="pt")).last_hidden_state[:, 0] for t in texts])
    got = torch.stack([torch.as_tensor(o.outputs.embedding) for o in LLM(enc_path, dtype="float32").embed(texts)])
    assert (got - F.normalize(ref, dim=-1)).abs().max() <= 1e-5
    pairs = [(texts[0], t) for t in texts[1:]]
    with torch.no_grad():
        ref = torch.cat([ce(**tok(a, b, return_tensors="pt")).logits for a, b in pairs])[:, 0]
    scores = torch.tensor([o.outputs.score for o in LLM(ce_path, dtype="float32").score(texts[0], texts[1:])])
    assert (scores - ref.sigmoid()).abs().max() <= 1e-5


QWEN3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
PROMPTS = [[5, 77, 301, 12, 9], list(range(20, 60)), [7] * 3 + list(range(100, 130))]


def test_qwen3_embedding_and_classifier_match_transformers(tmp_path):
    """Qwen3-Embedding's layout (a Qwen3Model checkpoint: last token, final norm) and Qwen3ForSequenceClassification,
    prompts in 16-token chunks."""
    from tiny_models import save_tiny
    from tiny_pooling import save_classifier
    from transformers import Qwen3Config

    emb = save_tiny(tmp_path / "e", Qwen3Config(**QWEN3, architectures=["Qwen3ForCausalLM"]), seed=7)
    with torch.no_grad():
        ref = torch.stack([emb.model(torch.tensor([p])).last_hidden_state[0, -1] for p in PROMPTS])
    emb.model.save_pretrained(tmp_path / "m")  # a Qwen3Model checkpoint, as Qwen3-Embedding ships
    for path in (tmp_path / "e", tmp_path / "m"):
        kw = {"runner": "pooling"} if path.name == "e" else {}
        llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                  tokenizer=str(tmp_path / "e"), **kw)
        got = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in PROMPTS])])
        assert (got - F.normalize(ref, dim=-1)).abs().max() <= 1e-5, path.name
    cls = save_classifier(tmp_path / "c", Qwen3Config(**QWEN3, num_labels=2, pad_token_id=511,
                                                      architectures=["Qwen3ForSequenceClassification"]))
    with torch.no_grad():
        ref = torch.cat([cls(torch.tensor([p])).logits for p in PROMPTS])
    llm = LLM(str(tmp_path / "c"), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    got = torch.tensor([o.outputs.probs for o in llm.classify([{"prompt_token_ids": p} for p in PROMPTS],
                                                               PoolingParams(activation=False))])
    assert (got - ref).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def gte(tmp_path_factory):
    from tiny_pooling import save_rope_bert

    enc, ce = tmp_path_factory.mktemp("tiny-gte"), tmp_path_factory.mktemp("tiny-gte-ce")
    return (str(enc), save_rope_bert(enc, "gte")), (str(ce), save_rope_bert(ce, "gte", head=True, seed=8))


def test_gte_embeddings_and_scores_match_transformers(gte):
    """GteModel (rotary, gated MLP, post-LN) CLS embeddings and GteForSequenceClassification pair scores."""
    from transformers import AutoTokenizer

    (enc_path, enc), (ce_path, ce) = gte
    tok = AutoTokenizer.from_pretrained(enc_path)
    with torch.no_grad():
        ref = torch.cat([enc(**tok(t, return_tensors="pt")).last_hidden_state[:, 0] for t in TEXTS])
    got = torch.stack([torch.as_tensor(o.outputs.embedding) for o in LLM(enc_path, dtype="float32").embed(TEXTS)])
    assert (got - F.normalize(ref, dim=-1)).abs().max() <= 1e-5
    pairs = [(TEXTS[0], t) for t in TEXTS[1:]]
    with torch.no_grad():
        ref = torch.cat([ce(**tok(a, b, return_tensors="pt")).logits for a, b in pairs])[:, 0]
    scores = torch.tensor([o.outputs.score for o in LLM(ce_path, dtype="float32").score(TEXTS[0], TEXTS[1:])])
    assert (scores - ref.sigmoid()).abs().max() <= 1e-5


def test_nomic_bert_matches_sentence_transformers(tmp_path):
    """NomicBertModel in a mean-pooled sentence-transformers folder, against sentence-transformers itself."""
    from sentence_transformers import SentenceTransformer
    from tiny_pooling import save_rope_bert, write_sentence_transformers_mean

    save_rope_bert(tmp_path, "nomic", seed=9)
    write_sentence_transformers_mean(tmp_path)
    ref = torch.as_tensor(SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS))
    got = torch.tensor([o.outputs.embedding for o in LLM(str(tmp_path), dtype="float32").embed(TEXTS)])
    assert F.cosine_similarity(got, ref).min() >= 0.9999
    assert (got - ref).abs().max() <= 1e-5


def test_qwen3_reranker_scores_are_yes_no_softmax(tmp_path):
    """An original Qwen3-Reranker (a Qwen3ForCausalLM, tied LM head) through vLLM's hf_overrides: the score is
    HF's softmax over the "no" / "yes" logits at the last token of each prompt."""
    from tiny_pooling import QWEN3_RERANKER_OVERRIDES, qwen3_reranker_reference, rerank_texts, save_qwen3_reranker

    model = save_qwen3_reranker(tmp_path, tied=True)
    query, docs = rerank_texts(TEXTS[0], TEXTS[1:])
    ref = qwen3_reranker_reference(model, tmp_path, query, docs)
    assert max(ref) - min(ref) > 1e-3  # the documents' scores differ: the test can tell them apart
    llm = LLM(str(tmp_path), dtype="float32", runner="pooling", hf_overrides=QWEN3_RERANKER_OVERRIDES,
              num_kv_blocks=64)
    scores = [o.outputs.score for o in llm.score(query, docs)]
    assert scores == pytest.approx(ref, abs=1e-5)
    # The same prompts a second time hit the prefix cache (a causal model pooling its last token keeps it).
    assert [o.outputs.score for o in llm.score(query, docs)] == pytest.approx(ref, abs=1e-5)


def test_classifier_from_token_refusals(tmp_path):
    from tiny_pooling import save_bert_cross_encoder, save_qwen3_reranker

    from vllite_core.errors import ConfigError

    save_qwen3_reranker(tmp_path / "q", tied=False)
    bad = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yess!"],
           "is_original_qwen3_reranker": True}
    with pytest.raises(ConfigError, match="classifier_from_token.*'yess!'"):
        LLM(str(tmp_path / "q"), dtype="float32", hf_overrides=bad)
    with pytest.raises(ConfigError, match="two tokens"):
        LLM(str(tmp_path / "q"), dtype="float32", hf_overrides={**bad, "classifier_from_token": ["yes"]})
    with pytest.raises(ConfigError, match="hf_overrides"):
        LLM(str(tmp_path / "q"), dtype="float32", hf_overrides=["architectures"])
    save_bert_cross_encoder(tmp_path / "b")
    with pytest.raises(ConfigError, match="not a causal LM served as a classifier"):
        LLM(str(tmp_path / "b"), dtype="float32", hf_overrides={"classifier_from_token": ["yes", "no"]})
