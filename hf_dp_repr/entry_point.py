"""What every entry point does first, in one place, before torch loads: each `recipes/*.py` file, the `hf-dp-repr`
command (`cli.main`) and the recipes' package (`hf_dp_repr/scripts/__init__.py`, so `python -m
hf_dp_repr.scripts.image_classification` too) call `prepare_entry_point()` before anything imports torch
(`tests/test_entry_points.py` checks each of them). Importing this module imports nothing heavy.

- `OMP_WAIT_POLICY=PASSIVE` (unless set): OpenMP reads it once, when torch loads its runtime, so it must be set
  before `import torch`. On a CPU shared with other jobs, threads that spin at barriers while other processes hold
  the cores made a MiniLM forward pass 8-12× slower (2 shared cores, load 2-4: 133 s instead of 11 s for 1147
  paragraphs), and the tiny-ViT sweeps (`seed000_sweep.py`, `lp_budget_split.py`) were reported to take 29 min
  instead of 1 min 54 s without it; passive threads sleep instead.
- `TOKENIZERS_PARALLELISM=false` (unless set): no fork warning from the tokenizers' thread pool.
- one intra-op thread for a tiny model on CPU (`one_thread_for_tiny_model`), unless `OMP_NUM_THREADS` says.

A library user's own script can call it first too:

    >>> import os
    >>> from hf_dp_repr.entry_point import prepare_entry_point
    >>> prepare_entry_point()
    >>> "OMP_WAIT_POLICY" in os.environ and "TOKENIZERS_PARALLELISM" in os.environ
    True
"""

from __future__ import annotations

import os
import sys


def prepare_entry_point(*, tiny_model: bool = False) -> None:
    """Set the process environment of this module's docstring (values already set win); with `tiny_model`, one
    intra-op thread as well. Call it before anything imports torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if tiny_model:
        one_thread_for_tiny_model()


def one_thread_for_tiny_model() -> None:
    """A tiny model on CPU gains nothing from intra-op threads, and on a busy machine OpenMP threads spinning at
    barriers made each step up to 10× slower (measured, 2 shared cores): use one, unless OMP_NUM_THREADS says.
    Before torch loads this sets OMP_NUM_THREADS=1 (read when torch loads); after, `torch.set_num_threads(1)`."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch = sys.modules.get("torch")
    if torch is None:
        os.environ["OMP_NUM_THREADS"] = "1"
    elif not torch.cuda.is_available():
        torch.set_num_threads(1)
