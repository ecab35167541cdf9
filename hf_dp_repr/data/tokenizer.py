"""A byte-level BPE tokenizer (GPT-2 style) trained locally with `tokenizers`, for runs that cannot fetch one.

Train it on PUBLIC text only: a tokenizer's vocabulary is a statistic of its training text, published with the model.

Example:
    >>> tok = train_tokenizer(["the secret code is 1 2 3", "Return the value."] * 20, vocab_size=300)
    >>> tok.decode(tok("Return the value.")["input_ids"])
    'Return the value.'
    >>> rows = padded_rows(["Return the value."], tok, max_length=32)
    >>> int(rows[0]["input_ids"][0]) == tok.bos_token_id, int(rows[0]["attention_mask"].sum()) < 32
    (True, True)
"""

from __future__ import annotations


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, as a fast HF tokenizer (`<|endoftext|>` is BOS, EOS and pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(texts), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok._trained_here = True
    return tok


def start_ids(tokenizer) -> list[int]:
    """What every training row starts with (and so every prompt or scored sequence): BOS if there is one."""
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def padded_rows(texts: list[str], tokenizer, max_length: int, columns: dict | None = None):
    """One causal-LM example per text (one unit of privacy each, unless a unit column says otherwise): BOS, the
    text's tokens, EOS, truncated to `max_length`, right-padded; labels −100 on the padding. `columns`: extra columns
    (e.g. a unit id), kept beside the torch-formatted ones."""
    from datasets import Dataset

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids = [(start_ids(tokenizer) + row)[:max_length - 1] + [eos]
           for row in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    data = {"input_ids": [r + [pad] * (max_length - len(r)) for r in ids],
            "attention_mask": [[1] * len(r) + [0] * (max_length - len(r)) for r in ids],
            "labels": [r + [-100] * (max_length - len(r)) for r in ids], **(columns or {})}
    return Dataset.from_dict(data).with_format("torch", columns=["input_ids", "attention_mask", "labels"],
                                               output_all_columns=True)
