"""A byte-level BPE tokenizer (GPT-2 style) trained locally with `tokenizers`, for runs that cannot fetch one.

Train it on PUBLIC text only: a tokenizer's vocabulary is a statistic of its training text, published with the model.

Example:
    >>> tok = train_tokenizer(["the secret code is 1 2 3", "Return the value."] * 20, vocab_size=300)
    >>> tok.decode(tok("Return the value.")["input_ids"])
    'Return the value.'
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
