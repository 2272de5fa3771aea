"""Pooling models offline (LLM.embed / classify / score / reward / encode) against their references:
sentence-transformers on all-MiniLM-L6-v2, and transformers on tiny random Qwen2 / BERT checkpoints."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY, save_tiny
from tiny_pooling import minilm_path, save_bert_cross_encoder, save_classifier

from vllite_core import LLM, PoolingParams
from vllite_core.errors import InvalidRequestError

SENTENCES = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "Bonjour, comment allez-vous aujourd'hui ?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "¿Dónde está la biblioteca más cercana?",
    "机器学习是人工智能的一个分支。",
    "Машинное обучение — это раздел искусственного интеллекта.",
    "a",
    "Embeddings map text to vectors so that similar meanings end up close together in the space.",
    "The stock market rallied after the central bank held interest rates steady for another quarter, "
    "surprising analysts who had expected a cut.",
    "I love pizza.", "Pizza is my favourite food.", "The weather is terrible today.",
    "It is raining cats and dogs.", "東京は日本の首都です。", "Paris is the capital of France.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Το γρήγορο καφέ αλεπού.", "नमस्ते दुनिया", "1 2 3 4 5 6 7 8 9 10",
    "Short.", "A slightly longer sentence, with punctuation; and clauses!",
    "def f(x): return x * 2", "SELECT * FROM users WHERE id = 1;",
    "The mitochondria is the powerhouse of the cell.", "¡Qué día tan bonito!",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
    "Cats sleep a lot.", "Dogs bark at strangers.", "Rome wasn't built in a day.",
    "Water boils at 100 degrees Celsius at sea level.", "The end." * 30,
]


@pytest.fixture(scope="module")
def minilm():
    return LLM(minilm_path(), dtype="float32")


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path(), device="cpu")


def test_minilm_matches_sentence_transformers(minilm, st_model):
    assert len(SENTENCES) == 32
    ref = st_model.encode(SENTENCES, convert_to_tensor=True, batch_size=32).float()
    outs = minilm.embed(SENTENCES)
    mine = torch.tensor([o.outputs.embedding for o in outs])
    assert mine.shape == (32, 384)
    assert F.cosine_similarity(mine, ref).min() >= 0.99999
    assert (mine - ref).abs().max() <= 1e-5
    # The longest one is cut at sentence-transformers' max_seq_length (256) by truncate_prompt_tokens.
    assert minilm.llm_engine.max_model_len == 256


def test_minilm_score_is_embedding_cosine(minilm, st_model):
    from sentence_transformers.util import cos_sim

    query, docs = "Where is the capital of France?", ["Paris is the capital of France.", "Cats sleep a lot."]
    scores = [o.outputs.score for o in minilm.score(query, docs)]
    emb = st_model.encode([query] + docs, convert_to_tensor=True)
    ref = cos_sim(emb[:1], emb[1:])[0].tolist()
    assert scores == pytest.approx(ref, abs=1e-5)
    assert scores[0] > scores[1]


@pytest.mark.parametrize("mode", ["cls", "lasttoken"])
def test_a_folder_saved_by_sentence_transformers_6_pools_as_it_says(tmp_path, mode):
    """sentence-transformers 6 writes ``"pooling_mode": "cls"`` in 1_Pooling/config.json where earlier versions
    wrote one boolean per mode: MiniLM saved by the installed sentence-transformers with another pooling than
    its own mean (and no Normalize) embeds as sentence-transformers does."""
    from sentence_transformers import SentenceTransformer, models

    word = models.Transformer(minilm_path(), max_seq_length=128)
    st = SentenceTransformer(modules=[word, models.Pooling(word.get_embedding_dimension(), mode)],
                             device="cpu")
    st.save(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32")
    ref = st.encode(SENTENCES[:8], convert_to_tensor=True).float()
    mine = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES[:8])])
    assert (mine - ref).abs().max() <= 1e-4


def test_minilm_bad_requests(minilm):
    with pytest.raises(InvalidRequestError) as e:
        minilm.embed(["hi"], PoolingParams(dimensions=128))
    assert e.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as e:
        minilm.embed([""])
    assert e.value.param == "input"
    with pytest.raises(InvalidRequestError) as e:
        minilm.embed([{"prompt_token_ids": [101] * 300}])
    assert e.value.param == "input" and "truncate_prompt_tokens" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        minilm.classify(["hi"])
    assert e.value.param == "task"
    with pytest.raises(InvalidRequestError) as e:
        minilm.generate(["hi"])
    assert e.value.param == "model" and "pooling model" in str(e.value)
    # The engine still serves after the refusals; truncation keeps the last tokens.
    long = [101] + [2000 + i for i in range(300)] + [102]
    out = minilm.embed([{"prompt_token_ids": long}], truncate_prompt_tokens=20)[0]
    ref = minilm.embed([{"prompt_token_ids": long[-20:]}])[0]
    assert out.prompt_token_ids == long[-20:] and out.outputs.embedding == ref.outputs.embedding


# ---- a causal LM with last-token pooling -------------------------------------------------------------

PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((5, 17, 40, 33, 64))]


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("tiny-qwen2-embed")
    model = save_tiny(path, Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"], is_matryoshka=True))
    with torch.no_grad():  # HF's final normed hidden state of each prompt's last token
        ref = [model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in PROMPTS]
    return str(path), torch.stack(ref)


def test_qwen2_last_token_embedding(qwen2_path):
    path, ref = qwen2_path
    llm = LLM(path, runner="pooling", dtype="float32", num_kv_blocks=64)
    raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False))
    assert (torch.tensor([o.outputs.embedding for o in raw]) - ref).abs().max() <= 1e-5
    normed = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in PROMPTS])])
    assert (normed - F.normalize(ref, dim=-1)).abs().max() <= 1e-5
    # Prefix caching hits on the second pass (same prompts), and the results are the same.
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    again = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in PROMPTS])])
    assert llm.llm_engine.get_stats().prefix_cache_hits > hits
    assert torch.equal(again, normed)
    # Matryoshka: the first 16 dimensions, normalised.
    cut = llm.embed([{"prompt_token_ids": PROMPTS[2]}], PoolingParams(dimensions=16))[0].outputs.embedding
    assert torch.tensor(cut) == pytest.approx(F.normalize(ref[2, :16], dim=-1), abs=1e-5)


def test_qwen2_embedding_chunked(qwen2_path):
    path, ref = qwen2_path
    llm = LLM(path, runner="pooling", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    assert llm.llm_engine.config.scheduler_config.enable_chunked_prefill
    raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False))
    assert (torch.tensor([o.outputs.embedding for o in raw]) - ref).abs().max() <= 1e-5


# ---- per-token pooling (token_embed) with chunked prefill and the prefix cache --------------------------

SHARED = [(11 * j) % 400 + 9 for j in range(32)]  # two full blocks (block size 16)
TOKEN_PROMPTS = [SHARED + [(5 * i + j) % 300 + 50 for j in range(n)] for i, n in enumerate((3, 21, 9))]
FRESH = [(13 * j) % 450 + 7 for j in range(40)]  # computed first by a per-token request


@pytest.fixture(scope="module")
def qwen2_token_ref(qwen2_path):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(qwen2_path[0], torch_dtype=torch.float32).eval()
    with torch.no_grad():  # HF's final normed hidden state of every prompt token
        return [model(torch.tensor([p])).last_hidden_state[0] for p in TOKEN_PROMPTS + [FRESH]]


def test_qwen2_token_embed_chunked_with_prefix_cache(qwen2_path, qwen2_token_ref):
    """Per-token requests are chunked (budget 16 splits every prompt) and take no prefix hits, while
    last-token requests in the same batch hit the shared prefix, and later ones hit blocks that only a
    per-token request computed."""
    llm = LLM(qwen2_path[0], runner="pooling", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    engine = llm.llm_engine
    assert engine.config.scheduler_config.enable_chunked_prefill and engine.config.cache_config.enable_prefix_caching
    tok, last = PoolingParams(normalize=False, task="token_embed"), PoolingParams(normalize=False, task="embed")
    engine.add_request("warm", {"prompt_token_ids": TOKEN_PROMPTS[0]}, last)  # caches the shared prefix
    llm._run(["warm"], False)
    ids = []
    for i, p in enumerate(TOKEN_PROMPTS):
        ids += [engine.add_request(f"all{i}", {"prompt_token_ids": p}, tok),
                engine.add_request(f"last{i}", {"prompt_token_ids": p}, last)]
    outs = {o.request_id: o for o in llm._run(ids, False)}
    for i, p in enumerate(TOKEN_PROMPTS):
        every, one, ref = outs[f"all{i}"], outs[f"last{i}"], qwen2_token_ref[i]
        assert every.num_cached_tokens == 0 and one.num_cached_tokens >= len(SHARED)
        assert every.pooling_output.shape == ref.shape
        assert (every.pooling_output - ref).abs().max() <= 1e-5
        assert (one.pooling_output - ref[-1]).abs().max() <= 1e-5
    fresh = llm.encode([{"prompt_token_ids": FRESH}], PoolingParams(normalize=False), pooling_task="token_embed")
    assert (fresh[0].outputs.data - qwen2_token_ref[-1]).abs().max() <= 1e-5
    engine.add_request("after", {"prompt_token_ids": FRESH}, last)
    after = llm._run(["after"], False)[0]
    assert after.num_cached_tokens == 32
    assert (after.pooling_output - qwen2_token_ref[-1][-1]).abs().max() <= 1e-5
    # Each token's embedding normalised on its own (the default for an embedding model).
    normed = llm.encode([{"prompt_token_ids": FRESH}], pooling_task="token_embed")[0].outputs.data
    assert (normed - F.normalize(qwen2_token_ref[-1], dim=-1)).abs().max() <= 1e-5


def test_qwen2_token_embed_preempted(qwen2_path, qwen2_token_ref):
    """A per-token request preempted mid-prompt drops the rows it kept and computes its prompt again."""
    llm = LLM(qwen2_path[0], runner="pooling", dtype="float32", num_kv_blocks=6, max_num_batched_tokens=32,
              long_prefill_token_threshold=8, max_num_partial_prefills=4)
    prompts = TOKEN_PROMPTS + [FRESH]
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False),
                      pooling_task="token_embed")
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
    for o, ref in zip(outs, qwen2_token_ref):
        assert (o.outputs.data - ref).abs().max() <= 1e-5
    assert not any(r.token_rows for r in llm.llm_engine.core.engine_core.worker.runner.requests.values())


# ---- sequence classification ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen2_classifier(tmp_path_factory):
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("tiny-qwen2-cls")
    model = save_classifier(path, Qwen2Config(**TINY, num_labels=3, pad_token_id=511,
                                              architectures=["Qwen2ForSequenceClassification"]))
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor([p])).logits for p in PROMPTS])
        per_token = model.score(model.model(torch.tensor([PROMPTS[2]])).last_hidden_state)[0]
    return str(path), ref, per_token


def test_qwen2_sequence_classification(qwen2_classifier):
    path, ref, per_token = qwen2_classifier
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    logits = torch.tensor([o.outputs.probs for o in llm.classify(prompts, PoolingParams(activation=False))])
    assert (logits - ref).abs().max() <= 1e-5
    probs = torch.tensor([o.outputs.probs for o in llm.classify(prompts)])
    assert (probs - ref.softmax(-1)).abs().max() <= 1e-5
    # Per-token logits (a 40-token prompt in 16-token chunks), activated per token as classify does.
    tokens = llm.encode(prompts[2], pooling_task="token_classify")[0].outputs.data
    assert (tokens - per_token.softmax(-1)).abs().max() <= 1e-5
    with pytest.raises(InvalidRequestError) as e:
        llm.embed(prompts[:1])
    assert e.value.param == "task"


def test_reward_is_one_label_head(tmp_path):
    from transformers import Qwen2Config

    model = save_classifier(tmp_path, Qwen2Config(**TINY, num_labels=1, pad_token_id=511,
                                                  architectures=["Qwen2ForSequenceClassification"]), seed=3)
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor([p])).logits for p in PROMPTS[:3]])
    llm = LLM(str(tmp_path), convert="reward", dtype="float32", num_kv_blocks=64)
    outs = llm.reward([{"prompt_token_ids": p} for p in PROMPTS[:3]])
    assert torch.stack([o.outputs.data for o in outs]).sub(ref).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def bert_cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bert-ce")
    return str(path), save_bert_cross_encoder(path)


PAIRS = [("what is the capital of france?", "paris is the capital of france."),
         ("what is the capital of france?", "bananas are yellow and rich in potassium."),
         ("what is the capital of france?", "france is a country in europe; its capital city is paris."),
         ("what is the capital of france?", "the eiffel tower.")]


def test_bert_cross_encoder_score_and_classify(bert_cross_encoder):
    from transformers import AutoTokenizer

    path, model = bert_cross_encoder
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        ref = torch.cat([model(**tok(a, b, return_tensors="pt")).logits for a, b in PAIRS])[:, 0]
    llm = LLM(path, dtype="float32")
    scores = torch.tensor([o.outputs.score for o in llm.score(PAIRS[0][0], [b for _, b in PAIRS])])
    assert (scores - ref.sigmoid()).abs().max() <= 1e-5
    raw = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], pooling_params=PoolingParams(activation=False))
    assert (torch.tensor([o.outputs.score for o in raw]) - ref).abs().max() <= 1e-5
    # classify on one text: segment A only.
    with torch.no_grad():
        one = model(**tok(PAIRS[1][1], return_tensors="pt")).logits[0]
    assert llm.classify([PAIRS[1][1]])[0].outputs.probs == pytest.approx(one.sigmoid().tolist(), abs=1e-5)
    with pytest.raises(InvalidRequestError) as e:  # its head reads the pooled [CLS] state, not each token
        llm.encode([PAIRS[1][1]], pooling_task="token_classify")
    assert e.value.param == "task"


def test_runner_and_convert_choices():
    from model_registry.models.bert import BertModel
    from model_registry.models.llama import LlamaForCausalLM
    from vllite_core.errors import ConfigError
    from vllite_core.model_interfaces import model_capabilities
    from vllite_core.pooling.setup import resolve_model_class

    assert resolve_model_class("BertModel", BertModel, "auto", "auto") is BertModel
    assert resolve_model_class("LlamaForCausalLM", LlamaForCausalLM, "auto", "auto") is LlamaForCausalLM
    embed = resolve_model_class("Qwen2ForCausalLM", LlamaForCausalLM, "pooling", "auto")
    assert model_capabilities(embed).is_pooling and embed.pooling_task == "embed"
    assert resolve_model_class("Qwen2ForCausalLM", LlamaForCausalLM, "auto", "classify").pooling_task == "classify"
    for args, field in ((("generate", "auto"), "runner"), (("pooling", "none"), "convert"),
                        (("pool", "auto"), "runner"), (("pooling", "rank"), "convert")):
        with pytest.raises(ConfigError, match=field):
            resolve_model_class("BertModel" if field == "runner" else "LlamaForCausalLM",
                                BertModel if field == "runner" else LlamaForCausalLM, *args)


def test_generative_model_serves_no_pooling_task(tiny_path):
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=32)
    with pytest.raises(InvalidRequestError) as e:
        llm.embed([{"prompt_token_ids": [5, 6, 7]}])
    assert e.value.param == "model" and "generative" in str(e.value)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}])[0].outputs[0].token_ids) > 0


def test_pooling_fault_fails_only_that_request(qwen2_path):
    """A model whose pooling raises for one request: that request fails, the rest of its batch are
    pooled as before and the engine keeps serving (the fault never leaves the runner)."""
    path, ref = qwen2_path
    # No prefix cache: the fault below is keyed on the rows a prompt runs in this step.
    llm = LLM(path, runner="pooling", dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    model = llm.llm_engine.core.engine_core.worker.runner.model
    real_pool = model.pool
    bad_len = len(PROMPTS[1])
    assert sum(len(p) == bad_len for p in PROMPTS) == 1

    def pool(hidden, cfg):
        if any(h.shape[0] == bad_len for h in hidden):
            raise RuntimeError("pool exploded")
        return real_pool(hidden, cfg)

    model.pool = pool
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False),
                      pooling_task="embed")
    for i, o in enumerate(outs):
        if i == 1:
            assert o.finished and o.outputs is None and "pool exploded" in o.error
        else:
            assert o.error is None and (o.outputs.data - ref[i]).abs().max() <= 1e-5
    embs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS[:3]], PoolingParams(normalize=False))
    assert embs[1].outputs is None and "pool exploded" in embs[1].error
    assert (torch.tensor(embs[2].outputs.embedding) - ref[2]).abs().max() <= 1e-5
    model.pool = real_pool
    again = llm.embed([{"prompt_token_ids": PROMPTS[1]}], PoolingParams(normalize=False))
    assert (torch.tensor(again[0].outputs.embedding) - ref[1]).abs().max() <= 1e-5
