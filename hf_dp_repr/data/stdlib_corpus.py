"""The embedded text corpus: the docstrings of Python's own standard library, and the three datasets made from it.

`stdlib_docstrings()` reads, in a fixed order, the docstrings of ~40 pure-Python stdlib modules and of their public
classes, methods and functions: about 0.4 MB of real technical English that ships with every Python (it changes a
little between Python versions; it is empty under `python -OO`, which strips docstrings). Each dataset has its own
name, one meaning each (the one loader, `hf_dp_repr.data.load_embedded`, serves them by that name):

- `stdlib-paragraphs` (`load_stdlib_paragraphs`): one paragraph per row (`text`), each distinct text once: the
  causal-LM recipe's documents (its unit of privacy). Its old name `stdlib-docs` still means this.
- `stdlib-blocks` (`load_stdlib_blocks`): the whole text tokenised and cut into full blocks of `block_size` ids,
  crossing paragraphs: `hf-dp-repr analyze`'s next-token corpus. Without a tokenizer, a byte-level fallback folds
  the text to ASCII (each non-ASCII character becomes "?") and uses each byte as a token id (ids < 128).
- `stdlib-topics` (`load_stdlib_topics`): paragraphs labelled by their module (text classification).

This module imports nothing of the package; only `hf_dp_repr.data` imports it.

Example:
    >>> ds = load_stdlib_blocks(block_size=64)          # byte-level fallback
    >>> len(ds["train"][0]["input_ids"]), ds["test"].num_rows > 100
    (64, True)
    >>> load_stdlib_paragraphs()["train"].column_names
    ['text']
"""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from collections import Counter
from functools import lru_cache
from typing import Any

import numpy as np
from datasets import Dataset, DatasetDict

from ..errors import ArgumentError, UnsupportedError

logger = logging.getLogger(__name__)

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
        raise UnsupportedError("the stdlib docstrings are missing (is Python running with -OO?); "
                               "use another text dataset")
    return tuple(docs)


def stdlib_text() -> str:
    """Docstrings of `STDLIB_MODULES` and their public members, separated by blank lines."""
    return "\n\n".join(doc for _, doc in stdlib_docstrings())


# ---- stdlib-paragraphs: one paragraph (document) per row -------------------------------------------------------
def load_stdlib_paragraphs(test_fraction: float = 0.1) -> DatasetDict:
    """The non-empty paragraphs of `stdlib_text()`, one per row (`text`); the last `test_fraction` is "test". Each
    distinct paragraph is kept once (`unique_documents`, test copies first)."""
    paragraphs = [p for p in stdlib_text().split("\n\n") if p.strip()]
    n_test = max(1, int(len(paragraphs) * test_fraction))
    train, test = unique_documents(paragraphs[:-n_test], paragraphs[-n_test:])
    return DatasetDict(train=Dataset.from_dict({"text": train}), test=Dataset.from_dict({"text": test}))


def unique_documents(train: list[str], evals: list[str], indices: bool = False):
    """Each distinct document (compared with whitespace normalised) once: its first copy in the eval split, else its
    first copy in the training split. Repeated paragraphs (an inherited docstring, a boilerplate line) would otherwise
    land on both sides of the public / private split, twice in the private set (one unit of privacy counted twice),
    or in train and eval. Returns the kept (train, eval) texts, or their indices with `indices=True`."""
    seen: set[str] = set()

    def keep(texts):
        out = []
        for i, text in enumerate(texts):
            key = " ".join(text.split())
            if key not in seen:
                seen.add(key)
                out.append(i)
        return out

    keep_eval = keep(evals)
    keep_train = keep(train)
    dropped = len(train) - len(keep_train) + len(evals) - len(keep_eval)
    if dropped:
        logger.info("%d repeated documents dropped (each distinct text kept once, eval copies first)", dropped)
    if indices:
        return keep_train, keep_eval
    return [train[i] for i in keep_train], [evals[i] for i in keep_eval]


# ---- stdlib-blocks: token blocks across paragraphs ---------------------------------------------------------------
def byte_tokenize(text: str, vocab_size: int) -> list[int]:
    """Byte-level fallback: ASCII-folded UTF-8 bytes as ids (all < 128)."""
    if vocab_size < 128:
        raise ArgumentError(f"the byte-level fallback needs a vocabulary of ≥ 128 tokens, the model has {vocab_size}; "
                            "save a tokenizer with the model")
    return list(text.encode("ascii", errors="replace"))


def load_stdlib_blocks(tokenizer: Any = None, *, vocab_size: int = 128, block_size: int = 128,
                       test_fraction: float = 0.1) -> DatasetDict:
    """`stdlib_text()` tokenised and cut into blocks of `block_size` ids; the last `test_fraction` is "test".

    `tokenizer`: a 🤗 tokenizer, or None for the byte-level fallback (then `vocab_size` is checked).
    Columns: `input_ids` and `attention_mask` (all ones: blocks are full).
    """
    if block_size < 2:
        raise ArgumentError(f"`block_size` must be ≥ 2 (a position and its next token), got {block_size}")
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
        raise ArgumentError(f"`block_size` {block_size} is too large for the corpus ({len(ids)} tokens)")

    def split(rows):
        data = {"input_ids": rows, "attention_mask": [[1] * block_size] * len(rows)}
        return Dataset.from_dict(data).with_format("torch")

    return DatasetDict(train=split(blocks[:-n_test]), test=split(blocks[-n_test:]))


# ---- stdlib-topics: paragraphs labelled by module ----------------------------------------------------------------
def load_stdlib_topics(min_examples_per_class: int = 50, min_chars: int = 40, test_size: float = 0.2,
                       seed: int = 0) -> DatasetDict:
    """A topic-classification task from real English that ships with Python: each example is one paragraph of a
    standard-library docstring (`stdlib_docstrings`), its label is the module the docstring comes from (`logging`,
    `inspect`, `doctest`, ...).

    Paragraphs shorter than `min_chars` characters are dropped, and so are modules with fewer than
    `min_examples_per_class` paragraphs (16 modules, about 1,430 paragraphs with the defaults on Python 3.11).
    Each distinct text appears once (`unique_paragraphs`): a paragraph repeated in several docstrings (inherited
    methods, "Base class for arithmetic errors.") would otherwise sit in train and test, or twice in the private
    set. Columns: `text` (str) and `labels` (ClassLabel named by module). The split is stratified and fixed by
    `seed`. Under DP, the unit of privacy is one paragraph: a docstring of several paragraphs is several examples.
    """
    from datasets import ClassLabel, Features, Value
    from sklearn.model_selection import train_test_split

    rows = unique_paragraphs([(" ".join(p.split()), module) for module, doc in stdlib_docstrings()
                              for p in doc.split("\n\n") if len(p.strip()) >= min_chars])
    counts = Counter(module for _, module in rows)
    names = [m for m in STDLIB_MODULES if counts[m] >= min_examples_per_class]
    if len(names) < 2:
        raise ArgumentError(f"min_examples_per_class={min_examples_per_class} leaves {len(names)} module(s); lower it")
    rows = [(text, names.index(module)) for text, module in rows if module in names]
    texts, labels = zip(*rows)
    idx_train, idx_test = train_test_split(np.arange(len(rows)), test_size=test_size, random_state=seed,
                                           stratify=labels)
    features = Features({"text": Value("string"), "labels": ClassLabel(names=names)})

    def split(idx):
        return Dataset.from_dict({"text": [texts[i] for i in idx], "labels": [labels[i] for i in idx]},
                                 features=features)

    return DatasetDict(train=split(idx_train), test=split(idx_test))


def unique_paragraphs(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(text, label) rows with each text once, at its first occurrence; a text found under several labels is
    dropped altogether (it cannot be classified)."""
    labels: dict[str, set[str]] = {}
    for text, label in rows:
        labels.setdefault(text, set()).add(label)
    seen: set[str] = set()
    out = []
    for text, label in rows:
        if text not in seen and len(labels[text]) == 1:
            out.append((text, label))
        seen.add(text)
    return out
