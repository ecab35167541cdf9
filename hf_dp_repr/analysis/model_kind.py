"""What kind of text model a 🤗 model is, which decides what its representations are measured against:

- a decoder-only causal LM (GPT-2, Llama): every position's hidden state against the next token (He & Su 2024);
- an encoder (BERT, MiniLM, RoBERTa): a bidirectional model sees the next token at every position, so a next-token
  residual would measure nothing; its [CLS] (or mean-pooled) state is measured against the example's class label.

The kind comes from transformers' own registries: a model type with a masked-LM head and no causal-LM head is an
encoder, one with a causal-LM head and no masked-LM head a decoder; types with both (BERT, RoBERTa) are decoders
only when configured as one (`config.is_decoder`).

Example:
    >>> from hf_dp_repr.analysis.model_kind import text_model_kind
    >>> from hf_dp_repr.tiny import tiny_bert_classifier, tiny_gpt2
    >>> text_model_kind(tiny_gpt2()), text_model_kind(tiny_bert_classifier())
    ('decoder', 'encoder')
"""

from __future__ import annotations

DECODER, ENCODER, ENCODER_DECODER, UNKNOWN = "decoder", "encoder", "encoder-decoder", "unknown"

__all__ = ["DECODER", "ENCODER", "ENCODER_DECODER", "UNKNOWN", "text_model_kind"]


def text_model_kind(model) -> str:
    """`DECODER`, `ENCODER`, `ENCODER_DECODER` or `UNKNOWN` (see the module docstring)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    from hf_dp_repr.privacy.loss import is_causal_lm

    config = getattr(model, "config", None)
    if config is None:
        return UNKNOWN
    if getattr(config, "is_encoder_decoder", False):
        return ENCODER_DECODER
    model_type = getattr(config, "model_type", None)
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if causal and masked:
        return DECODER if getattr(config, "is_decoder", False) else ENCODER
    if causal or is_causal_lm(model):
        return DECODER
    if masked:
        return ENCODER
    return UNKNOWN
