"""Per-layer features from `output_hidden_states=True`, streamed into D_l / PR_l statistics batch by batch.

What is read from each hidden state `hidden_states[l]` (l = 0 is the embedding output):
  - vision ("image-classification"): the [CLS] token (position 0) of every layer, or with `pooling="mean"`
    the mean of the tokens after it (the patches). The [CLS] token of the *embedding output* is the same
    learned vector for every image, so D_0 and PR_0 would be 0/0; under [CLS] pooling layer 0 is therefore
    read as the mean patch embedding (the report's `notes` say so). 4-D maps (B, C, H, W) of conv nets are
    average-pooled. Targets: the class label (D and scalar PR, or one-hot PR with `one_hot_classes`).
  - language ("causal-lm", decoder-only models): every non-padding position that has a non-padding next token; the
    target is that next token as a class (He & Su 2024's next-token prediction): its one-hot over the vocabulary,
    or beyond 256 tokens a fixed random sketch of it (`next_token_codes`), never its id, whose order is arbitrary.
    D is not computed: its "classes" would be the whole vocabulary.
  - text classification ("text-classification", encoders such as BERT/MiniLM): one vector per example, the [CLS]
    token (position 0) or with `pooling="mean"` the mean of its non-padding tokens; targets: the class label, as
    for vision. Under [CLS] pooling layer 0 is read as the mean of the tokens after [CLS] (the [CLS] embedding is
    the same for every example). A bidirectional encoder sees the next token, so it gets no next-token analysis.

Only per-layer sufficient statistics are kept (class counts, means and within-class scatter for D; the
centred scatter of [x, y] for PR), so memory is O(layers · d²) whatever the number of examples or tokens.
The model runs in eval mode under `torch.no_grad()`; its training mode is restored afterwards.

Example:
    >>> from hf_dp_repr.data import load_digits_dataset
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> from hf_dp_repr.analysis import analyze_representations
    >>> report = analyze_representations(tiny_vit(), load_digits_dataset()["test"], batch_size=128)
    >>> report.num_layers, report.num_examples, report.fuzziness_law is not None
    (5, 360, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ArgumentError, DataError, MissingColumnError
from .batches import LABELLED, TASKS, TEXT, VISION, batch_size_of, detect_task, iter_batches, language_inputs, to_tensor
from .law import fuzziness_law, residual_law
from .law_report import RepresentationReport
from .residual import ResidualStats, next_token_codes
from .separation import SeparationStats

__all__ = ["analyze_representations", "extract_features", "POOLINGS"]

POOLINGS = ("cls", "mean")
LAYER0_NOTE = "layer 0 ([CLS] of the embedding output is constant) is read as the mean patch embedding"
TEXT_LAYER0_NOTE = "layer 0 ([CLS] of the embedding output is constant) is read as the mean of the other tokens"
PROGRESS_MIN_BATCHES = 20  # show a progress bar by default only for runs longer than this


def analyze_representations(
    model: torch.nn.Module,
    dataset: Any,
    *,
    task: str = "auto",
    pooling: str = "cls",
    batch_size: int = 64,
    max_examples: int | None = None,
    label_column: str = "labels",
    one_hot_classes: int | None = None,
    progress: bool | None = None,
) -> RepresentationReport:
    """Measure D_l and PR_l at every hidden state of `model` on `dataset`, streaming, and fit both laws.

    Args:
        model: a 🤗 model whose forward accepts `output_hidden_states=True` (e.g. ViTForImageClassification,
            ViTModel, GPT2LMHeadModel).
        dataset: a 🤗 Dataset/IterableDataset with `pixel_values` + `label_column` (vision) or `input_ids`
            [+ `attention_mask`] (language), or any iterable of such batch dicts (a DataLoader).
        task: "image-classification", "causal-lm", "text-classification" (an encoder on labelled text), or "auto"
            (from the columns: `pixel_values` → vision, `input_ids` → causal-lm).
        pooling: vision and text classification, "cls" or "mean" (patch / non-padding tokens).
        batch_size: rows per forward pass (ignored for iterables of ready batches).
        max_examples: stop after this many rows.
        label_column: column holding the class id (vision, text classification).
        one_hot_classes: vision only; regress PR on one-hot labels of this many classes instead of the scalar
            label (the seed papers use the scalar label).
        progress: show a tqdm bar; default: only for runs of more than 20 batches.
    """
    if task not in ("auto", *TASKS):
        raise ArgumentError(f"`task` must be 'auto' or one of {TASKS}, got {task!r}")
    if pooling not in POOLINGS:
        raise ArgumentError(f"`pooling` must be one of {POOLINGS}, got {pooling!r}")
    sep: list[SeparationStats] = []
    res: list[ResidualStats] = []
    examples = positions = 0
    for task, rows, layers, labels in _stream(model, dataset, task, pooling, batch_size, max_examples,
                                              label_column, progress):
        examples += rows
        if len(labels) == 0:  # e.g. a batch of one-token sequences: nothing to predict
            continue
        if not res:
            codes = None if task in LABELLED else next_token_codes(_vocab_size(model, labels))  # one table, shared
            res = [ResidualStats(num_classes=one_hot_classes, class_codes=codes) for _ in layers]
            sep = [SeparationStats() for _ in layers] if task in LABELLED else []
        for stats, feats in zip(res, layers):
            stats.update(feats, labels)
        for stats, feats in zip(sep, layers):
            stats.update(feats, labels)
        positions += len(labels)
    if not res:
        raise DataError("no rows to analyse: the dataset is empty or has no predicted positions "
                        "(language sequences need at least 2 non-padding tokens)")
    dim = max(stats.dim for stats in res)
    unreliable = {}
    if positions <= dim + 1:  # the residual of an exact fit: reported, but flagged and withheld from tables
        unreliable["residual"] = (f"only {positions} rows for {dim}-dim features: the least-squares fit is exact, so "
                                  f"PR_l ≈ 0 says nothing about the layers; analyse more than {dim + 1} "
                                  "examples/tokens")
        warnings.warn(unreliable["residual"])
    residual = [stats.residual() for stats in res]
    fuzziness = [stats.fuzziness() for stats in sep] if sep else None
    notes = [{VISION: LAYER0_NOTE, TEXT: TEXT_LAYER0_NOTE}[task]] if task in LABELLED and pooling == "cls" else []
    return RepresentationReport(
        task=task,
        pooling=pooling if task in LABELLED else "tokens",
        num_examples=examples,
        num_positions=positions,
        residual=residual,
        fuzziness=fuzziness,
        fuzziness_law=fuzziness_law(fuzziness) if fuzziness else None,
        residual_law=residual_law(residual),
        notes=notes,
        unreliable=unreliable,
    )


def extract_features(
    model: torch.nn.Module,
    dataset: Any,
    *,
    layer: int = -1,
    task: str = "auto",
    pooling: str = "cls",
    batch_size: int = 64,
    max_examples: int | None = None,
    label_column: str = "labels",
    progress: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """All features of one layer in memory, as (features n × d float32, labels or next-token ids (n,)).

    Reads the same positions as `analyze_representations`; meant for the kNN probe and UMAP plots.

    Example:
        >>> from hf_dp_repr.data import load_digits_dataset
        >>> from hf_dp_repr.tiny import tiny_vit
        >>> feats, labels = extract_features(tiny_vit(), load_digits_dataset()["test"], layer=-1)
        >>> feats.shape, labels.shape
        ((360, 64), (360,))
    """
    chunks, targets = [], []
    for _, _, layers, labels in _stream(model, dataset, task, pooling, batch_size, max_examples, label_column,
                                     progress, only_layer=layer):
        chunks.append(layers[0].float().cpu().numpy())
        targets.append(labels.cpu().numpy())
    if not chunks:
        raise DataError("no rows to extract: the dataset is empty")
    return np.concatenate(chunks), np.concatenate(targets)


def _stream(model, dataset, task, pooling, batch_size, max_examples, label_column, progress, only_layer=None
            ) -> Iterator[tuple[str, int, list[torch.Tensor], torch.Tensor]]:
    """Yield (task, rows, per-layer features, targets) per batch, with the model in eval mode and no grad."""
    batches, total = iter_batches(dataset, batch_size, max_examples)
    show = progress if progress is not None else (total is None or total > PROGRESS_MIN_BATCHES)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in tqdm(batches, total=total, desc="hidden states", disable=not show, leave=False):
                batch_task = detect_task(batch) if task == "auto" else task
                rows = batch_size_of(batch)
                if batch_task == VISION:
                    yield batch_task, rows, *_vision(model, batch, device, pooling, label_column, only_layer)
                elif batch_task == TEXT:
                    yield batch_task, rows, *_text(model, batch, device, pooling, label_column, only_layer)
                else:
                    yield batch_task, rows, *_language(model, batch, device, only_layer)
    finally:
        model.train(was_training)


def _hidden_states(model, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out = model(**inputs, output_hidden_states=True, return_dict=True)
    hidden = getattr(out, "hidden_states", None)
    if hidden is None:
        raise ArgumentError(f"{type(model).__name__} returned no `hidden_states` for output_hidden_states=True; "
                            "use a 🤗 model that supports it")
    return hidden


def _vision(model, batch, device, pooling, label_column, only_layer):
    if label_column not in batch:
        raise MissingColumnError(f"vision analysis needs class ids in column `{label_column}`; got {sorted(batch)} "
                                 "(set `label_column=`)")
    pixels = to_tensor(batch["pixel_values"]).to(device=device, dtype=next(model.parameters()).dtype)
    labels = to_tensor(batch[label_column]).to(device).long()
    hidden = _hidden_states(model, {"pixel_values": pixels})
    indices = range(len(hidden)) if only_layer is None else [range(len(hidden))[only_layer]]
    return [_pool(hidden[i], i, pooling) for i in indices], labels


def _pool(h: torch.Tensor, layer: int, pooling: str) -> torch.Tensor:
    if h.ndim == 4:  # (B, C, H, W) feature maps of conv nets
        return h.mean(dim=(2, 3))
    if h.ndim != 3:
        raise DataError(f"hidden state {layer} has shape {tuple(h.shape)}; expected (B, tokens, d) or (B, C, H, W)")
    if pooling == "mean" or layer == 0:
        if h.shape[1] < 2:
            raise ArgumentError(f"hidden state {layer} has a single token; use pooling='cls'")
        return h[:, 1:].mean(dim=1)
    return h[:, 0]


def _text(model, batch, device, pooling, label_column, only_layer):
    if label_column not in batch:
        raise MissingColumnError(f"text classification needs class ids in column `{label_column}`; got {sorted(batch)} "
                                 "(set `label_column=`)")
    ids, mask = language_inputs(batch)
    ids, mask = ids.to(device), mask.to(device)
    labels = to_tensor(batch[label_column]).to(device).long()
    hidden = _hidden_states(model, {"input_ids": ids, "attention_mask": mask})
    indices = range(len(hidden)) if only_layer is None else [range(len(hidden))[only_layer]]
    return [_pool_text(hidden[i], mask, i, pooling) for i in indices], labels


def _pool_text(h: torch.Tensor, mask: torch.Tensor, layer: int, pooling: str) -> torch.Tensor:
    if pooling == "cls" and layer > 0:
        return h[:, 0]
    weights = mask.to(h.dtype).clone()
    if pooling == "cls":  # layer 0: the [CLS] embedding is constant, read the mean of the tokens after it
        weights[:, 0] = 0
    count = weights.sum(dim=1, keepdim=True)
    if bool((count == 0).any()):
        raise DataError(f"hidden state {layer}: an example has no token to average (only [CLS]); drop empty texts")
    return (h * weights[..., None]).sum(dim=1) / count


def _vocab_size(model: torch.nn.Module, first_targets: torch.Tensor) -> int:
    """The number of token ids the next-token target ranges over: the output embedding's rows (else the config's
    vocab_size, else the largest id seen in the first batch + 1; a later larger id is then a DataError)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if size else int(first_targets.max()) + 1


def _language(model, batch, device, only_layer):
    ids, mask = language_inputs(batch)
    ids, mask = ids.to(device), mask.to(device)
    hidden = _hidden_states(model, {"input_ids": ids, "attention_mask": mask})
    # Position t predicts token t+1: both must be real tokens (works for left and right padding).
    valid = mask[:, :-1].bool() & mask[:, 1:].bool()
    targets = ids[:, 1:][valid]
    indices = range(len(hidden)) if only_layer is None else [range(len(hidden))[only_layer]]
    return [hidden[i][:, :-1][valid] for i in indices], targets
