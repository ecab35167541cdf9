"""One mechanism that makes a `transformers.Trainer` subclass train with DP-SGD: `dp_trainer_class(SomeTrainer)`.

It works for a trainer whose loss is a sum of per-example terms. The class it returns is
`class DPSomeTrainer(DPTrainer, SomeTrainer)`: `SomeTrainer` still prepares the data (tokenising, chat templates,
masks), builds its collator, evaluates and logs; `DPTrainer` (first in the method order) owns what the guarantee
depends on: Poisson sampling of examples or units, per-example clipping (ghost norms or Opacus hooks), noise once
per logical batch from the run's secret, the ledger, ε in the logs, checkpoints, resume, DDP and FSDP2, the card.
In training, `SomeTrainer.compute_loss` is never called: DPTrainer's `training_step` calls its loss hooks,

- `per_example_loss(outputs, labels)`: each example's loss from the model's outputs (default: token cross-entropy
  averaged over the example's own tokens whose label is not -100, as `privacy.loss.per_example_loss`);
- `example_losses(model, inputs)`: the forward and the per-example losses of one micro-batch (override this one when
  the loss needs more than `outputs` and `labels`, e.g. DPO's chosen and rejected sequences of one pair);
- `examples_in_batch(inputs)`: how many examples the micro-batch holds (default: the rows of `labels`).

The trainer's own metrics of the training batches (TRL's `_metrics["train"]`: token accuracy, entropy, DPO's rewards,
...) are computed on private examples outside DP-SGD: never logged (`DPMechanism.log`); evaluation's are.

The arguments are `dp_config_class(SomeConfig)`: a dataclass that is both `DPTrainingArguments` and `SomeConfig`
(HfArgumentParser, YAML and the trainer's own CLI flags work), with the trainer's defaults kept except where DP-SGD
needs another (`DP_DEFAULTS`) and `bf16` on only where the device supports it.

TRL trainers: `SFTTrainer` and `DPOTrainer` are tested (`hf_dp_repr.trl.DPSFTTrainer`, `DPDPOTrainer`); every other
TRL trainer is refused with an `UnsupportedError` saying why (`REFUSED`): their losses couple examples (KTO's batch KL
estimate, GRPO's group advantages) or train on the model's own generations, which this mechanism does not privatise.

Example (a Trainer subclass whose loss is one squared error per example):
    >>> import torch
    >>> from transformers import Trainer
    >>> from hf_dp_repr.trl.mechanism import dp_trainer_class
    >>> class SquaredErrorTrainer(Trainer):
    ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    ...         return ((model(**inputs).logits.squeeze(-1) - inputs["labels"]) ** 2).mean()
    >>> def squared_error(self, outputs, labels):  # the same loss, one value per example
    ...     return (outputs.logits.squeeze(-1).float() - labels.float()) ** 2
    >>> DPSquaredErrorTrainer = dp_trainer_class(SquaredErrorTrainer, per_example_loss=squared_error)
    >>> DPSquaredErrorTrainer.__name__, DPSquaredErrorTrainer.per_example_loss is squared_error
    ('DPSquaredErrorTrainer', True)
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable

from transformers import Trainer, TrainingArguments

from ..errors import ArgumentTypeError, DPConfigError, UnsupportedError
from ..training.arguments import DPTrainingArguments
from ..training.privacy_report import DPPublishedLogs
from ..training.trainer import DPTrainer

# The TRL trainers this mechanism is tested on (class name → their DP config, "module:name", made by dp_config_class).
TESTED = {"SFTTrainer": "hf_dp_repr.trl.sft:DPSFTConfig", "DPOTrainer": "hf_dp_repr.trl.dpo:DPDPOConfig"}
_COUPLED = ("its loss couples the examples of a batch", "one example would move every other example's loss")
_ONLINE = ("it trains on completions the model generates during training, scored against the other completions of "
           "their group (advantages normalised per group)", "an example's loss depends on its group and on sampling "
           "that DP-SGD does not account")
# TRL trainers refused, with why (any other TRL trainer is refused as untested).
REFUSED = {
    "KTOTrainer": ("its loss subtracts a KL estimate computed over the whole batch (mismatched prompt/completion "
                   "pairs)", _COUPLED[1]),
    "GRPOTrainer": _ONLINE, "RLOOTrainer": _ONLINE, "PPOTrainer": _ONLINE, "OnlineDPOTrainer": _ONLINE,
    "GKDTrainer": _ONLINE, "DistillationTrainer": _ONLINE,
    "RewardTrainer": ("it is not tested under DP by hf-dp-repr (its optional reward centring adds a batch term)",
                      "the per-example clipping of its pairs is unverified"),
}
# TrainingArguments defaults of TRL configs that DP-SGD refuses or cannot honour as they are: reset here.
DP_DEFAULTS = {
    # TRL turns activation checkpointing on; its non-reentrant default hides activations from the per-example hooks
    # (refused by DPTrainingArguments). The Trainer's default (off): turn it on with use_reentrant=True.
    "gradient_checkpointing": None,
}


def _trl_base(trainer_cls: type) -> type | None:
    """The most derived class of `trainer_cls`'s method order that TRL defines (None: no TRL trainer)."""
    return next((c for c in trainer_cls.__mro__ if c.__module__.split(".")[0] == "trl"
                 and issubclass(c, Trainer) and c.__name__ != "_BaseTrainer"), None)


def check_supported(trainer_cls: type) -> None:
    """Refuse (UnsupportedError) a TRL trainer this mechanism is not tested on, naming why and what works."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ArgumentTypeError(f"dp_trainer_class: {trainer_cls!r} is not a transformers.Trainer subclass.")
    if issubclass(trainer_cls, DPTrainer):
        raise ArgumentTypeError(f"dp_trainer_class: {trainer_cls.__name__} is already a DPTrainer.")
    base = _trl_base(trainer_cls)
    if base is None or base.__name__ in TESTED:
        return
    what, harm = REFUSED.get(base.__name__, ("it is not tested under DP by hf-dp-repr", "its loss may not be a sum "
                                             "of per-example terms"))
    raise UnsupportedError(
        f"dp_trainer_class: trl's {base.__name__} is refused under DP-SGD: {what}, so {harm}. DP-SGD needs a loss that "
        f"is a sum of per-example terms. Supported: {', '.join(sorted(TESTED))} (hf_dp_repr.trl.DPSFTTrainer, "
        "DPDPOTrainer), and any Trainer subclass whose loss you give per example (per_example_loss=...).")


def bf16_default(args: TrainingArguments) -> bool:
    """TRL's `bf16=None` default (bf16 unless fp16) where the device runs bf16 (a GPU that supports it); off on a
    CPU, where a mixed-precision run would fail or only slow down."""
    import torch

    if args.fp16 or getattr(args, "use_cpu", False):
        return False
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


class _DeviceDefaults:
    """Resolves the config's device-dependent defaults before TrainingArguments reads them."""

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = bf16_default(self)
        super().__post_init__()


def dp_config_class(config_cls: type, name: str | None = None, doc: str | None = None) -> type:
    """A dataclass that is both `DPTrainingArguments` and `config_cls` (a TrainingArguments subclass, e.g.
    `trl.SFTConfig`): every field of both, `config_cls`'s own defaults where it changes the Trainer's (TRL's
    learning rate, logging_steps, ...) except those in `DP_DEFAULTS`, DPTrainingArguments' DP defaults
    (max_grad_norm=0, ...), and `bf16` on only where the device supports it (`bf16_default`)."""
    if not (dataclasses.is_dataclass(config_cls) and issubclass(config_cls, TrainingArguments)):
        raise ArgumentTypeError(f"dp_config_class: {config_cls!r} is not a TrainingArguments dataclass.")
    plain = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    dp_own = {f.name for f in dataclasses.fields(DPTrainingArguments)
              if f.name not in plain or f.default is not plain[f.name].default}
    kept = []
    for f in dataclasses.fields(config_cls):
        if f.name in dp_own or f.name not in plain:
            continue  # DP's own choice, or a field of config_cls alone (inherited as it is)
        default = DP_DEFAULTS.get(f.name, f.default)
        if default is plain[f.name].default and f.default_factory is plain[f.name].default_factory:
            continue
        kept.append((f.name, f.type, dataclasses.field(default=default, metadata=f.metadata)))
    name = name or f"DP{config_cls.__name__}"
    cls = dataclasses.make_dataclass(name, kept, bases=(_DeviceDefaults, DPTrainingArguments, config_cls))
    cls.__doc__ = doc or (f"The arguments of a DP-SGD run of {config_cls.__name__}'s trainer: every field of "
                          f"`{config_cls.__name__}` and of `DPTrainingArguments` (hf_dp_repr.trl.dp_config_class).")
    # The Trainer pickles its arguments (training_args.bin): assign the class to `name` at the caller's module level.
    cls.__module__ = sys._getframe(1).f_globals.get("__name__", __name__)
    return cls


def dp_trainer_class(trainer_cls: type, *, config_class: type | None = None,
                     per_example_loss: Callable | None = None, name: str | None = None) -> type:
    """`class DP<trainer_cls>(DPTrainer, trainer_cls)`: the trainer under DP-SGD (see the module docstring).

    `config_class`: the arguments it takes (default: `dp_config_class` of the TRL config, for a TRL trainer;
    `DPTrainingArguments` otherwise). `per_example_loss(self, outputs, labels) -> (batch,)`: the loss of each
    example, required when `trainer_cls` overrides `compute_loss` (whose batch loss DP-SGD cannot clip per example);
    for another shape of batch, subclass the result and override `example_losses` / `examples_in_batch`.
    TRL trainers other than SFTTrainer and DPOTrainer are refused (`check_supported`).
    """
    check_supported(trainer_cls)
    overrides_loss = trainer_cls.compute_loss is not Trainer.compute_loss
    if overrides_loss and per_example_loss is None and _trl_base(trainer_cls) is None:
        raise UnsupportedError(
            f"dp_trainer_class: {trainer_cls.__name__} overrides compute_loss, whose batch loss DP-SGD cannot clip per "
            "example (and which DPTrainer's training step does not call). Pass per_example_loss=fn, where fn(trainer, "
            "outputs, labels) returns each example's loss (shape (batch,)): the same objective, per example.")
    if config_class is None:
        base = _trl_base(trainer_cls)
        config_class = DPTrainingArguments if base is None else _resolve(TESTED[base.__name__])
    body = {"dp_config_class": config_class, "__doc__": f"{trainer_cls.__name__} under DP-SGD "
            "(hf_dp_repr.trl.dp_trainer_class): takes its arguments as a `dp_config_class` instance.",
            }  # (in training, DPTrainer's loss hooks; trainer_cls.compute_loss only in evaluation)
    if per_example_loss is not None:
        body["per_example_loss"] = per_example_loss
    # DPPublishedLogs after trainer_cls: every log, the trainer's own metrics added, is filtered before Trainer.log
    return type(name or f"DP{trainer_cls.__name__}", (DPMechanism, DPTrainer, trainer_cls, DPPublishedLogs), body)


def load_model(model, args):
    """`model` given by name loaded as TRL loads it (`args.model_init_kwargs`), before DPTrainer checks and shards
    it; a model instance unchanged."""
    if not isinstance(model, str):
        return model
    from trl.trainer.utils import create_model_from_path

    return create_model_from_path(model, **dict(getattr(args, "model_init_kwargs", None) or {}))


def check_no_rows_dropped(trainer, given) -> None:
    """n (and q, σ, the card's count) must not depend on a private record's content: refuse, before training, a
    training set from which the trainer's data preparation dropped rows (TRL drops a row that truncation to
    `max_length` leaves without loss tokens, or whose prompt alone fills it)."""
    prepared = trainer.train_dataset
    if not (hasattr(given, "__len__") and hasattr(prepared, "__len__")) or len(prepared) >= len(given):
        return
    args = trainer.args
    raise DPConfigError(
        f"{type(trainer).__name__}: preparing the training set dropped {len(given) - len(prepared)} of its "
        f"{len(given)} rows (left without loss tokens by truncation to max_length={getattr(args, 'max_length', None)}"
        f", truncation_mode={getattr(args, 'truncation_mode', None)!r}), so the number of examples n, and with it q "
        "and σ, would depend on a private record's content. Fix: a larger max_length (or max_length=None), or "
        "truncation_mode='keep_end'.")


def _resolve(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class DPMechanism:
    """First base of a `dp_trainer_class` class: checks its arguments' class, loads a model given by name (as TRL
    does, before DPTrainer checks and shards it) and passes everything on by keyword."""

    dp_config_class: type = DPTrainingArguments

    def __init__(self, model=None, args=None, **kwargs):
        config = type(self).dp_config_class
        if not isinstance(args, config):
            raise ArgumentTypeError(
                f"{type(self).__name__}: `args` must be a {config.__name__} (both the trainer's config and "
                f"DPTrainingArguments: it holds the privacy budget), got {type(args).__name__}.")
        self._saving_checkpoint = False
        given = kwargs.get("train_dataset")
        super().__init__(model=load_model(model, args), args=args, **kwargs)
        check_no_rows_dropped(self, given)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """TRL trainers' own metrics of the training batches (`_metrics["train"]`: token accuracy, entropy, DPO's
        rewards and log-probabilities, ...) are computed on private examples outside DP-SGD: never logged (nor in
        `log_history`, nor sent to trackers). Evaluation's are logged like the eval loss; ε is logged."""
        metrics = getattr(self, "_metrics", None)
        if self.model.training and isinstance(metrics, dict) and "train" in metrics:
            metrics["train"].clear()
        super().log(logs, *args, **kwargs)

    def _send_telemetry(self) -> None:
        """TRL pings the Hub about each run (trainer, model type, device); nothing about a private run leaves here."""

    def _save_checkpoint(self, model, trial):
        self._saving_checkpoint = True  # TRL's override writes its own card first: the DP card replaces it
        try:
            return super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def create_model_card(self, *args, **kwargs):
        """The DP model card (DPTrainer's). TRL's checkpoint save asks for its card, named after the folder: the DP
        card of the checkpoint is DPTrainer's own, written with the caller's model_card_info unchanged."""
        if self._saving_checkpoint and self.ledger is not None:
            return None
        return super().create_model_card(*args, **kwargs)
