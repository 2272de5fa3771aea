"""RoBERTa and XLM-RoBERTa encoders (bge-m3's dense embeddings, bge-reranker and other cross-encoders):
BERT's layers (``bert``) with RoBERTa's two differences. Positions start after the padding index
(``pad_token_id + 1``, fairseq's numbering; a prompt here never holds padding), and the classification
head is ``classifier.dense`` -> tanh -> ``classifier.out_proj`` on the ``<s>`` token, which is BERT's
pooler -> classifier under other names. Pair prompts come from the tokenizer (``<s> A </s></s> B </s>``,
one token type)."""
from __future__ import annotations

from model_registry.models.bert import BertForSequenceClassification, BertModel


class RobertaNumbering:
    """RoBERTa's checkpoint prefix and position numbering, for either head."""

    weight_prefix = "roberta."
    config: object

    def position_offset(self) -> int:
        return _offset(self.config)

    @classmethod
    def get_max_model_len(cls, hf_config: object) -> int:
        """The positions left after the offset (bge-m3: 8194 - 2 = 8192)."""
        return int(getattr(hf_config, "max_position_embeddings")) - _offset(hf_config)


def _offset(hf_config: object) -> int:
    return int(getattr(hf_config, "pad_token_id", 1)) + 1


class XLMRobertaModel(RobertaNumbering, BertModel):
    pass


class XLMRobertaForSequenceClassification(RobertaNumbering, BertForSequenceClassification):
    head_weights = {"classifier.dense.weight": "pooler.weight", "classifier.dense.bias": "pooler.bias",
                    "classifier.out_proj.weight": "classifier.weight", "classifier.out_proj.bias": "classifier.bias"}
