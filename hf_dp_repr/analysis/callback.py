"""`RepresentationLawCallback`: D_l / PR_l and their laws at train start, at every evaluation and at the end.

Privacy: statistics of the *training* set computed during DP training are a release that no accountant
counts. The callback therefore analyses the trainer's `eval_dataset` by default and warns loudly (Python
warning + log) when the analysis set is the training set (same object or same 🤗 fingerprint).

Logging goes through `trainer.log`, the path every `report_to` tracker listens to, so the callback needs the
trainer: pass it at construction or call `attach(trainer)`. Without one, metrics are appended to
`state.log_history` only (with a warning: trackers will not see them, and the training-set check is off).

Files (main process only), in `args.output_dir`: `representation_law.json` (every analysis so far) and
`representation_law.png` (log-scale D_l and PR_l against layer, one line per analysis).

Example:
    >>> from transformers import PrinterCallback, Trainer, TrainingArguments
    >>> from hf_dp_repr.data import load_digits_dataset
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> from hf_dp_repr.analysis import RepresentationLawCallback
    >>> import tempfile
    >>> ds = load_digits_dataset()
    >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, report_to="none", disable_tqdm=True,
    ...                          per_device_train_batch_size=32, use_cpu=True)
    >>> trainer = Trainer(model=tiny_vit(), args=args, train_dataset=ds["train"], eval_dataset=ds["test"])
    >>> trainer.remove_callback(PrinterCallback)  # keep the example's output quiet
    >>> trainer.add_callback(RepresentationLawCallback(trainer=trainer))
    >>> _ = trainer.train()
    >>> any("repr/fuzziness/rho" in entry for entry in trainer.state.log_history)
    True
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..errors import ArgumentError
from .features import analyze_representations
from .law_report import RepresentationReport
from .plots import plot_laws

__all__ = ["RepresentationLawCallback"]

logger = logging.getLogger(__name__)

TRAIN_SET_WARNING = (
    "RepresentationLawCallback is analysing the TRAINING set. Representation statistics of private training "
    "data are a release that no privacy accountant counts, so they void the DP guarantee if published. "
    "Analyse held-out or public data instead (the default is the trainer's eval_dataset)."
)


class RepresentationLawCallback(TrainerCallback):
    """Log `repr/...` metrics (D_l, PR_l per layer; ρ and r of each law) and write the law JSON + PNG.

    Args:
        analysis_dataset: data to analyse (see `analyze_representations`); default: `trainer.eval_dataset`.
        trainer: the Trainer to log through (or call `attach(trainer)` later).
        task: passed to `analyze_representations`, as are `pooling`, `batch_size`, `max_examples`, `label_column`.
        metric_prefix: prefix of the logged metric names.
        json_name: the law JSON's file name in `args.output_dir` (`plot_name`: the PNG's).
    """

    def __init__(
        self,
        analysis_dataset: Any = None,
        *,
        trainer: Any = None,
        task: str = "auto",
        pooling: str = "cls",
        batch_size: int = 64,
        max_examples: int | None = None,
        label_column: str = "labels",
        metric_prefix: str = "repr/",
        json_name: str = "representation_law.json",
        plot_name: str = "representation_law.png",
    ) -> None:
        self.analysis_dataset = analysis_dataset
        self.trainer = trainer
        self.analyze_kwargs = dict(task=task, pooling=pooling, batch_size=batch_size, max_examples=max_examples,
                                   label_column=label_column)
        self.metric_prefix = metric_prefix
        self.json_name, self.plot_name = json_name, plot_name
        self.history: list[dict] = []  # one entry per analysis, as written to the JSON
        self._dataset: Any = None
        self._warned_no_trainer = False

    def attach(self, trainer: Any) -> "RepresentationLawCallback":
        """Log through `trainer` and default to its eval set; returns self."""
        self.trainer = trainer
        return self

    # --- TrainerCallback events -------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._dataset = self._resolve_dataset()
        self._analyse("train_begin", args, state, model)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if self._dataset is None:  # evaluate() called outside train()
            self._dataset = self._resolve_dataset()
        self._analyse("evaluate", args, state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.history or self.history[-1]["step"] != state.global_step:
            self._analyse("train_end", args, state, model)

    # --- internals ------------------------------------------------------------------------------------------
    def _resolve_dataset(self) -> Any:
        dataset = self.analysis_dataset
        if dataset is None:
            eval_dataset = getattr(self.trainer, "eval_dataset", None)
            if eval_dataset is None:
                raise ArgumentError("RepresentationLawCallback has nothing to analyse: pass `analysis_dataset=` or "
                                    "give the trainer an `eval_dataset` (and the callback the trainer)")
            if isinstance(eval_dataset, dict):
                raise ArgumentError(f"the trainer has several eval sets {sorted(eval_dataset)}; pick one with "
                                    "`analysis_dataset=`")
            dataset = eval_dataset
        if self.trainer is not None and _same_dataset(dataset, getattr(self.trainer, "train_dataset", None)):
            warnings.warn(TRAIN_SET_WARNING, UserWarning, stacklevel=3)
            logger.warning(TRAIN_SET_WARNING)
        return dataset

    def _analyse(self, event: str, args, state, model) -> None:
        if model is None:
            raise ArgumentError("RepresentationLawCallback got no `model` from the trainer")
        report = analyze_representations(model, self._dataset, progress=False, **self.analyze_kwargs)
        self._log(report.metrics(self.metric_prefix), state)
        self.history.append({"event": event, "step": state.global_step, "epoch": state.epoch,
                             **report.to_dict()})
        if state.is_world_process_zero:
            self._write(Path(args.output_dir))

    def _log(self, metrics: dict[str, float], state) -> None:
        if self.trainer is not None:
            self.trainer.log(dict(metrics))
            return
        if not self._warned_no_trainer:
            warnings.warn("RepresentationLawCallback has no trainer attached: its metrics go to "
                          "state.log_history only (report_to trackers will not see them) and the analysis set "
                          "is not checked against the training set. Use `trainer.add_callback("
                          "RepresentationLawCallback(trainer=trainer))` or `callback.attach(trainer)`.",
                          UserWarning, stacklevel=3)
            self._warned_no_trainer = True
        state.log_history.append({**metrics, "epoch": state.epoch, "step": state.global_step})

    def _write(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / self.json_name).write_text(json.dumps({"analyses": self.history}, indent=2))
        curves: dict[str, RepresentationReport] = {}
        for entry in self.history:
            label = _label(entry)
            label = label if label not in curves else f"{label} #{len(curves)}"  # repeated evaluate() calls
            curves[label] = RepresentationReport.from_dict(entry)
        plot_laws(curves, out_dir / self.plot_name, title="representation laws during training")


def _label(entry: dict) -> str:
    names = {"train_begin": "start", "evaluate": "eval", "train_end": "end"}
    return f"step {entry['step']} ({names[entry['event']]})"


def _same_dataset(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    if a is b:
        return True
    fa, fb = getattr(a, "_fingerprint", None), getattr(b, "_fingerprint", None)
    return fa is not None and fa == fb
