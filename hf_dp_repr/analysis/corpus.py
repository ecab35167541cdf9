"""An offline text corpus for the next-token law: the docstrings of Python's own standard library.

`stdlib_text()` concatenates, in a fixed order, the docstrings of ~40 pure-Python stdlib modules and of their
public classes, methods and functions: about 0.4 MB of real technical English that ships with every Python
(it changes a little between Python versions; it is empty under `python -OO`, which strips docstrings).

Tokenisation: with the model's tokenizer when it has one; otherwise a byte-level fallback where the text is
folded to ASCII (each non-ASCII character becomes "?") and each byte is its own token id, so ids are < 128
and fit any vocabulary of at least 128 tokens.

Example:
    >>> from hf_dp_repr.analysis.corpus import load_text_dataset
    >>> ds = load_text_dataset(block_size=64)          # byte-level fallback
    >>> len(ds["train"][0]["input_ids"]), ds["test"].num_rows > 100
    (64, True)
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from functools import lru_cache
from typing import Any

from datasets import Dataset, DatasetDict

__all__ = ["STDLIB_MODULES", "byte_tokenize", "load_text_dataset", "stdlib_docstrings", "stdlib_text"]

STDLIB_MODULES = (
    "argparse", "collections", "json", "pathlib", "re", "subprocess", "typing", "unittest", "logging",
    "email", "functools", "itertools", "os", "shutil", "tarfile", "zipfile", "datetime", "decimal",
    "fractions", "statistics", "random", "string", "textwrap", "difflib", "csv", "configparser", "threading",
    "inspect", "dataclasses", "enum", "contextlib", "abc", "pickle", "copy", "heapq", "bisect", "calendar",
    "gettext", "optparse", "doctest", "smtplib", "ftplib",
)  # fmt: skip


@lru_cache(maxsize=1)
def stdlib_docstrings() -> tuple[tuple[str, str], ...]:
    """(module name, docstring) of `STDLIB_MODULES` and their public classes, methods and functions, in a fixed
    order; empty docstrings are left out."""
    docs: list[tuple[str, str]] = []
    with warnings.catch_warnings():  # reading typing.io / typing.re docstrings warns of their deprecation
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in STDLIB_MODULES:
            module = importlib.import_module(name)
            objects = [module]
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                    continue
                if getattr(obj, "__module__", None) != module.__name__:
                    continue
                objects.append(obj)
                if inspect.isclass(obj):
                    objects.extend(m for a, m in sorted(vars(obj).items())
                                   if not a.startswith("_") and inspect.isfunction(m))
            docs.extend((name, doc) for doc in map(inspect.getdoc, objects) if doc)
    if sum(len(doc) for _, doc in docs) < 10_000:
        raise RuntimeError("the stdlib docstrings are missing (is Python running with -OO?); "
                           "use another text dataset")
    return tuple(docs)


def stdlib_text() -> str:
    """Docstrings of `STDLIB_MODULES` and their public members, separated by blank lines."""
    return "\n\n".join(doc for _, doc in stdlib_docstrings())


def byte_tokenize(text: str, vocab_size: int) -> list[int]:
    """Byte-level fallback: ASCII-folded UTF-8 bytes as ids (all < 128)."""
    if vocab_size < 128:
        raise ValueError(f"the byte-level fallback needs a vocabulary of ≥ 128 tokens, the model has {vocab_size}; "
                         "save a tokenizer with the model")
    return list(text.encode("ascii", errors="replace"))


def load_text_dataset(tokenizer: Any = None, *, vocab_size: int = 128, block_size: int = 128,
                      test_fraction: float = 0.1) -> DatasetDict:
    """`stdlib_text()` tokenised and cut into blocks of `block_size` ids; the last `test_fraction` is "test".

    `tokenizer`: a 🤗 tokenizer, or None for the byte-level fallback (then `vocab_size` is checked).
    Columns: `input_ids` and `attention_mask` (all ones: blocks are full).
    """
    if block_size < 2:
        raise ValueError(f"`block_size` must be ≥ 2 (a position and its next token), got {block_size}")
    paragraphs = stdlib_text().split("\n\n")
    if tokenizer is None:
        ids = byte_tokenize("\n\n".join(paragraphs), vocab_size)
    else:
        # Per paragraph, so no single call exceeds the tokenizer's length limit; rejoined with the separator.
        sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
        ids = []
        for row in tokenizer(paragraphs, add_special_tokens=False)["input_ids"]:
            ids.extend(row + sep)
    blocks = [ids[i : i + block_size] for i in range(0, len(ids) - block_size + 1, block_size)]
    n_test = max(1, int(len(blocks) * test_fraction))
    if len(blocks) - n_test < 1:
        raise ValueError(f"`block_size` {block_size} is too large for the corpus ({len(ids)} tokens)")

    def split(rows):
        data = {"input_ids": rows, "attention_mask": [[1] * block_size] * len(rows)}
        return Dataset.from_dict(data).with_format("torch")

    return DatasetDict(train=split(blocks[:-n_test]), test=split(blocks[-n_test:]))
