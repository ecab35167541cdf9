"""The start-of-training probe's batch (`privacy.row_probe`): the fewest rows and tokens that prove what it checks.

What the probe proves is about rows: that the model's forward and `per_example_loss` keep examples apart (an example's
loss is the same whatever rows surround it), that every trained module's first dimension follows the examples, and
that no trained tensor is used outside its module. Mixing along the batch dimension (batch statistics, a batch-wide
normalisation, a module fed (T, B, d)) shows on two examples and on a few tokens as on the whole batch, so:

- two examples (`PROBE_EXAMPLES`): the first forward on rows (0, 1), the second on (1, 0, 1), reordered with a copy
  of its first row (which tells an example-major (B·T, d) module from a sequence-first (T, B, d) one, whatever T);
- a text batch cut to its first `PROBE_TOKENS` tokens (`shortened`), or further where a row's first supervised
  token (a label other than -100, attended) lies beyond them: every row keeps a loss, else the cut proves nothing
  about it. What is cut: the tensors of shape (rows, T, ...) with T the length of `input_ids`.

A model whose forward refuses the cut batch, or gives a non-finite loss on it, is probed on the whole batch
(`row_probe.probe_training_rows`). For a 1B model (sequence 256) the probe then costs two forwards on 2 + 3 rows of
16 tokens instead of 3 + 4 rows of 256 (`benchmarks/lora_1b_start.py`).

    >>> import torch
    >>> ids = torch.arange(40).reshape(2, 20)
    >>> labels = ids.clone()
    >>> labels[1, :18] = -100  # the second row's prompt is not supervised
    >>> {k: tuple(v.shape) for k, v in shortened({"input_ids": ids, "labels": labels}).items()}
    {'input_ids': (2, 19), 'labels': (2, 19)}
    >>> shortened({"input_ids": ids, "labels": ids})["input_ids"].shape
    torch.Size([2, 16])
"""

from __future__ import annotations

import torch

PROBE_EXAMPLES = 2  # the model runs twice per train(): on these rows, then on 3 (reordered, plus a copy)
PROBE_FORWARDS, PROBE_ROWS = 2, 2 * PROBE_EXAMPLES + 1  # with a dataset of at least PROBE_EXAMPLES rows
PROBE_TOKENS = 16  # the text batch's length in the probe, at least (`shortened`)
IGNORE_INDEX = -100  # a label the loss skips


def probe_order(k: int) -> list[int]:
    """The second forward's rows: the k examples reversed, then a copy of its first row."""
    return [*range(k - 1, -1, -1), k - 1]


def _first(flags: torch.Tensor) -> torch.Tensor:
    """Each row's first True position (rows without one: their length)."""
    t = flags.shape[1]
    positions = torch.arange(t, device=flags.device).expand_as(flags)
    return torch.where(flags, positions, t).min(1).values


def shortened(batch: dict) -> dict:
    """`batch` with its token dimension cut to the first `PROBE_TOKENS` tokens, or to just past the last row's first
    supervised (and attended) token; the batch as it is when that is its whole length or it has no `input_ids`."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] <= PROBE_TOKENS:
        return batch
    t = ids.shape[1]
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    attended = (mask != 0 if isinstance(mask, torch.Tensor) and mask.shape == ids.shape
                else torch.ones_like(ids, dtype=torch.bool))
    needed = attended
    if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:
        needed = attended & (labels != IGNORE_INDEX)
        needed[:, 0] = False  # a causal LM predicts no first token
    length = max(PROBE_TOKENS, int(_first(needed).max()) + 1)
    if length >= t:
        return batch
    return {k: v[:, :length] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == ids.shape else v
            for k, v in batch.items()}
