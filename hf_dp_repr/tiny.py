"""Tiny, randomly initialised HF models built from configs: for tests, offline demos and benchmarks.

Example:
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> model = tiny_vit(num_labels=10)
    >>> model.config.num_hidden_layers
    4
"""

from __future__ import annotations

from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)


def tiny_vit_config(num_labels: int = 10, image_size: int = 8, num_channels: int = 1, **overrides) -> ViTConfig:
    """A 4-block ViT for 8×8 single-channel images (sklearn digits), 2×2 patches, width 64."""
    kwargs = dict(
        image_size=image_size,
        patch_size=2,
        num_channels=num_channels,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_labels,
    )
    kwargs.update(overrides)
    return ViTConfig(**kwargs)


def tiny_vit(num_labels: int = 10, seed: int = 0, **overrides) -> ViTForImageClassification:
    import torch

    torch.manual_seed(seed)
    return ViTForImageClassification(tiny_vit_config(num_labels=num_labels, **overrides))


def tiny_gpt2_config(vocab_size: int = 128, n_positions: int = 64, **overrides) -> GPT2Config:
    """A 2-block GPT-2 of width 32 (tied wte/lm_head, transformers' Conv1D layers, as the real one)."""
    kwargs = dict(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    import torch

    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(**overrides))


def tiny_gpt2_classifier(num_labels: int = 2, seed: int = 0, **overrides) -> GPT2ForSequenceClassification:
    import torch

    torch.manual_seed(seed)
    return GPT2ForSequenceClassification(tiny_gpt2_config(num_labels=num_labels, **overrides))


def tiny_bert_classifier(num_labels: int = 2, vocab_size: int = 128, seed: int = 0,
                         **overrides) -> BertForSequenceClassification:
    """A 2-block BERT of width 32 with a pooler and a classification head (dropout off)."""
    import torch

    kwargs = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, num_labels=num_labels, pad_token_id=0)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(**kwargs))


def tiny_llama(vocab_size: int = 128, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-block Llama-style causal LM of width 32 (RMSNorm, rotary positions, untied lm_head)."""
    import torch

    kwargs = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
                  tie_word_embeddings=False)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**kwargs))
