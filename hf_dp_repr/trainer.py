"""`DPTrainer`: DP-SGD inside `transformers.Trainer`.

What changes against the plain Trainer, and nothing else:
- batches: Poisson sampling of logical batches (`privacy.sampler`), split into the accumulation micro-batches;
- gradients: Opacus per-sample gradient hooks on the unwrapped HF model (so what is saved is a plain HF
  model), each example's gradient clipped after its micro-batch, Gaussian noise once per logical step;
- loss: the sum of per-example losses (`privacy.loss`), overridable through `per_example_loss`;
- accounting: σ calibrated for the whole planned run, a `PrivacyLedger` stepped at every update, `epsilon`
  in every log, the ledger in every checkpoint and restored by `resume_from_checkpoint`.

Example (runs in seconds on a CPU):
    >>> from hf_dp_repr import DPTrainer, DPTrainingArguments
    >>> from hf_dp_repr.data import load_digits_dataset
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> ds = load_digits_dataset()
    >>> args = DPTrainingArguments(output_dir="/tmp/dp-doc", target_epsilon=8.0, target_delta=1e-4,
    ...     per_device_train_batch_size=64, max_steps=3, learning_rate=1e-3, report_to="none",
    ...     save_strategy="no", disable_tqdm=True)
    >>> trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=ds["train"])
    >>> out = trainer.train()
    >>> trainer.ledger.steps_done, 0 < out.metrics["epsilon"] <= 8.0
    (3, True)
"""

from __future__ import annotations

import math
import warnings

import datasets
import torch
from opacus.grad_sample import GradSampleHooks
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging

from .config import DPTrainingArguments
from .privacy import grad_samplers  # noqa: F401  (registers HF grad samplers into Opacus)
from .privacy.accounting import LEDGER_FILE, PrivacyLedger, calibrate_noise_multiplier
from .privacy.loss import per_example_loss
from .privacy.optimizer import make_dp_optimizer
from .privacy.sampler import PoissonBatchSampler, ShuffledBatchSampler
from .privacy.validation import check_model_is_privatizable

logger = logging.get_logger(__name__)

# Ledger fields that must match between a checkpoint and the resumed run, or the accounting would be wrong.
_RESUME_INVARIANTS = ("accountant", "target_delta", "noise_multiplier", "sample_rate", "planned_steps",
                      "per_sample_max_grad_norm", "clipping", "expected_batch_size", "dataset_size", "world_size")


class DPTrainer(Trainer):
    """A `transformers.Trainer` that trains with DP-SGD as configured by `DPTrainingArguments`.

    Takes the same arguments as `Trainer`. The training loss logged by the Trainer is computed on private
    data and is not covered by the DP guarantee (which covers the weights); ε is logged as `epsilon`.
    """

    def __init__(self, model=None, args: DPTrainingArguments | None = None, train_dataset=None, **kwargs):
        if not isinstance(args, DPTrainingArguments):
            raise TypeError("DPTrainer: `args` must be a DPTrainingArguments (it holds the privacy budget).")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                "DPTrainer: compute_loss_func returns a batch loss; DP-SGD needs one loss per example. "
                "Subclass DPTrainer and override `per_example_loss(outputs, labels)` instead."
            )
        if train_dataset is not None:
            _check_train_dataset(train_dataset, args)
        if model is not None:
            check_model_is_privatizable(model)
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        self.ledger: PrivacyLedger | None = None
        self._dp_optimizer = None
        self._grad_sample_hooks = None
        self._batch_sampler = None
        self._resume_ledger: PrivacyLedger | None = None
        self._epsilon_cache: tuple[int, float] | None = None
        self._shifts_labels = _is_causal_lm(self.model)
        self.add_callback(_SamplerEpochCallback(self))

    # ---- the privacy plan -------------------------------------------------------------------------
    def privacy_plan(self) -> PrivacyLedger:
        """The ledger this run will fill: sample rate, planned steps and σ (calibrated if a target ε is set)."""
        args = self.args
        n = len(self.train_dataset)
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        if batch > n:
            raise ValueError(
                f"DPTrainer: the logical batch (per_device_train_batch_size × gradient_accumulation_steps × "
                f"processes = {batch}) exceeds the {n} training examples; lower the batch size."
            )
        steps_per_epoch = max(1, n // batch)
        planned = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        sample_rate = batch / n
        sigma = args.noise_multiplier
        if sigma is None:
            sigma = calibrate_noise_multiplier(args.target_epsilon, args.target_delta, sample_rate, planned,
                                               args.accountant)
        return PrivacyLedger(
            accountant=args.accountant, target_delta=args.target_delta, noise_multiplier=sigma,
            sample_rate=sample_rate, planned_steps=planned, per_sample_max_grad_norm=args.per_sample_max_grad_norm,
            clipping=args.clipping, expected_batch_size=batch, dataset_size=n,
            poisson_sampling=args.poisson_sampling, target_epsilon=args.target_epsilon, world_size=args.world_size,
        )

    # ---- data: Poisson logical batches --------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset.")
        args = self.args
        dataset, collator = self.train_dataset, self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        n = len(dataset)
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        common = dict(num_samples=n, steps_per_epoch=max(1, n // batch),
                      micro_batches_per_step=args.gradient_accumulation_steps, world_size=args.world_size,
                      rank=args.process_index, seed=args.data_seed if args.data_seed is not None else args.seed)
        if args.poisson_sampling:
            self._batch_sampler = PoissonBatchSampler(sample_rate=batch / n, secure=args.secure_mode, **common)
        else:
            self._batch_sampler = ShuffledBatchSampler(batch_size=batch, **common)
        # Not passed through accelerate.prepare: sharding would re-split our (already per-rank) batches.
        return DataLoader(dataset, batch_sampler=self._batch_sampler, collate_fn=_EmptyAwareCollator(collator),
                          num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory)

    # ---- optimizer: Opacus hooks + DP optimizer -------------------------------------------------------
    def create_optimizer(self, model=None):
        if self._dp_optimizer is not None and self.optimizer is self._dp_optimizer:
            self._attach_hooks()
            return self.optimizer
        super().create_optimizer(model)
        self.ledger = self._start_ledger()
        self._attach_hooks()
        self._dp_optimizer = make_dp_optimizer(
            self.optimizer, clipping=self.args.clipping, noise_multiplier=self.ledger.noise_multiplier,
            max_grad_norm=self.args.per_sample_max_grad_norm, expected_batch_size=self.ledger.expected_batch_size,
            world_size=self.args.world_size, rank=self.args.process_index, secure_mode=self.args.secure_mode,
        )
        self._dp_optimizer.attach_step_hook(lambda _opt: self.ledger.record_step())
        self.optimizer = self._dp_optimizer
        self._announce_plan()
        return self.optimizer

    def _start_ledger(self) -> PrivacyLedger:
        plan = self.privacy_plan()
        if self._resume_ledger is None:
            return plan
        old = self._resume_ledger
        changed = [f"{k}: checkpoint {getattr(old, k)!r} vs now {getattr(plan, k)!r}"
                   for k in _RESUME_INVARIANTS if getattr(old, k) != getattr(plan, k)]
        if changed:
            raise ValueError("DPTrainer: cannot resume, the privacy plan changed since the checkpoint "
                             "(resume with the same arguments and data):\n  " + "\n  ".join(changed))
        if old.steps_done != self.state.global_step:
            raise ValueError(f"DPTrainer: the checkpoint's ledger counts {old.steps_done} DP steps but its trainer "
                             f"state {self.state.global_step}; the checkpoint is inconsistent.")
        return old

    def _attach_hooks(self) -> None:
        if self._grad_sample_hooks is None:
            for name, p in self.model.named_parameters():
                p._dp_name = name  # for error messages that name the parameter
            self._grad_sample_hooks = GradSampleHooks(self.model, batch_first=True, loss_reduction="sum", strict=True)

    def _detach_hooks(self) -> None:
        if self._grad_sample_hooks is not None:
            self._grad_sample_hooks.remove_hooks()
            self._grad_sample_hooks = None
        for p in self.model.parameters():
            for attr in ("grad_sample", "summed_grad", "_forward_counter"):
                if hasattr(p, attr):
                    delattr(p, attr)

    def _announce_plan(self) -> None:
        led = self.ledger
        if led.noise_multiplier == 0:
            logger.warning("DPTrainer: noise_multiplier=0. This run is NOT differentially private (ε = ∞); "
                           "per-example clipping only, as a non-private reference.")
        if not led.poisson_sampling:
            logger.warning("DPTrainer: poisson_sampling=False. Batches are shuffled and fixed-size; the ε reported "
                           "is computed as if they were Poisson-sampled and is NOT a proven guarantee.")
        target = f"target ε={led.target_epsilon}" if led.target_epsilon is not None else "σ given"
        logger.warning(
            f"DP-SGD plan: σ={led.noise_multiplier:.4f} ({target}), δ={led.target_delta:g}, accountant={led.accountant}, "
            f"sample rate q={led.sample_rate:.5f} (expected batch {led.expected_batch_size} of {led.dataset_size}), "
            f"{led.planned_steps} steps, clipping={led.clipping} C={led.per_sample_max_grad_norm}; "
            f"ε at the end of the plan: {led.planned_epsilon():.4f}"
        )

    # ---- one micro-batch ----------------------------------------------------------------------------
    def per_example_loss(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """Loss of each example of the micro-batch, shape (batch,). Override for custom objectives."""
        return per_example_loss(outputs.logits, labels, shift_labels=self._shifts_labels)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        if not inputs:  # an empty Poisson micro-batch: it contributes nothing but the step still happens
            return torch.zeros((), device=self.args.device)
        model.train()
        inputs = self._prepare_inputs(inputs)
        if "labels" not in inputs:
            raise ValueError("DPTrainer: the batch has no `labels`; per-example losses need them.")
        labels = inputs.pop("labels")
        _batch_position_ids(self.model, inputs)
        with self.compute_loss_context_manager():
            losses = self.per_example_loss(model(**inputs), labels)
        self.accelerator.backward(losses.sum())
        self._dp_optimizer.accumulate_micro_batch()
        return losses.detach().mean() / self.current_gradient_accumulation_steps

    # ---- run, log, save -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        self._resume_ledger = None
        if resume_from_checkpoint:
            path = (get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True
                    else resume_from_checkpoint)
            if path is None:
                raise ValueError(f"DPTrainer: no checkpoint found in {self.args.output_dir} to resume from.")
            try:
                self._resume_ledger = PrivacyLedger.load(path)
            except FileNotFoundError:
                raise ValueError(f"DPTrainer: checkpoint {path} has no {LEDGER_FILE}; resuming would lose the "
                                 "privacy accounting. Resume only from checkpoints written by DPTrainer.") from None
            self._dp_optimizer = None
            self.optimizer = None
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._detach_hooks()
        output.metrics["epsilon"] = self.epsilon()
        return output

    def epsilon(self) -> float | None:
        """ε spent so far (computed by the ledger's Opacus accountant), None before training."""
        if self.ledger is None:
            return None
        steps = self.ledger.steps_done
        if self._epsilon_cache is None or self._epsilon_cache[0] != steps:
            self._epsilon_cache = (steps, self.ledger.epsilon())
        return self._epsilon_cache[1]

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        # The Trainer's `grad_norm` would be the norm of a non-private gradient: never log it.
        logs.pop("grad_norm", None)
        if self.ledger is not None:
            logs["epsilon"] = self.epsilon()
        super().log(logs, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.ledger is not None and self.args.should_save:
            self.ledger.save(output_dir or self.args.output_dir)


class _SamplerEpochCallback(TrainerCallback):
    """Tells the batch sampler which epoch starts, so batches depend only on (seed, epoch), also on resume."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.trainer._batch_sampler is not None:
            self.trainer._batch_sampler.set_epoch(int(state.epoch or 0))


class _EmptyAwareCollator:
    """Collates as usual, but an empty Poisson micro-batch becomes {} instead of crashing the collator."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        return self.collator(features) if features else {}


def _batch_position_ids(model, inputs: dict) -> None:
    """Give `position_ids` a real batch dimension. HF models build them with batch 1, which gives the position
    embedding a per-sample gradient of batch 1 (Opacus then crashes on GPT-2 and BERT)."""
    ids = inputs.get("input_ids")
    if ids is None or "position_ids" in inputs or "position_ids" not in _forward_params(model):
        return
    inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


def _is_causal_lm(model) -> bool:
    """Causal LMs predict token t+1 at position t, so their labels are shifted (HF's ForCausalLMLoss)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    is_decoder_only = not getattr(getattr(base, "config", None), "is_encoder_decoder", False)
    return getattr(base, "loss_function", None) is ForCausalLMLoss and is_decoder_only


def _forward_params(model) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _check_train_dataset(dataset, args: DPTrainingArguments) -> None:
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            "DPTrainer: train_dataset must have a length (a map-style dataset): Poisson sampling and the privacy "
            "accounting need n. Materialise the IterableDataset first (e.g. `Dataset.from_generator`)."
        )
    n = len(dataset)
    if n == 0:
        raise ValueError("DPTrainer: train_dataset is empty.")
    if args.target_delta >= 1 / n:
        warnings.warn(
            f"DPTrainer: target_delta={args.target_delta:g} is >= 1/n for n={n} training examples; such a δ allows "
            f"releasing a few examples outright. Use δ < 1/n, e.g. {1 / (10 * n):.1e}.",
            stacklevel=3,
        )
