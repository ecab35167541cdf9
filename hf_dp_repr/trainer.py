"""`DPTrainer`: DP-SGD inside `transformers.Trainer`.

What changes against the plain Trainer, and nothing else:
- batches: Poisson sampling of logical batches (`privacy.sampler`), split into the accumulation micro-batches;
- gradients: Opacus per-sample gradient hooks on the unwrapped HF model (so what is saved is a plain HF
  model), each example's gradient clipped after its micro-batch, Gaussian noise once per logical step;
- loss: the sum of per-example losses (`privacy.loss`), overridable through `per_example_loss`;
- accounting: σ calibrated for the whole planned run (`plan`), a `PrivacyLedger` stepped at every update, `epsilon`
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
    >>> out = trainer.train()  # with disable_tqdm=True the Trainer prints the final metrics
    {'train_runtime': ...}
    >>> trainer.ledger.steps_done, 0 < out.metrics["epsilon"] <= 8.0
    (3, True)
"""

from __future__ import annotations

import contextlib

import datasets
import torch
from opacus.grad_sample import GradSampleHooks
from torch.utils.data import DataLoader
from transformers import Trainer, default_data_collator
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import ModelOutput
from transformers.utils import logging

from .cached_head import prepare_cached_head, set_probe_modes
from .config import DPTrainingArguments, check_hub_strategy
from .plan import plan_run, resume_ledger
from .privacy.accounting import LEDGER_FILE, PrivacyLedger
from .privacy.ghost_clipping import GhostClippingEngine, unsupported_reason
from .privacy.grad_samplers import batch_position_ids  # importing it registers HF grad samplers into Opacus
from .privacy.loss import is_causal_lm, per_example_loss
from .privacy.optimizer import MicroBatchDPOptimizer
from .privacy.randomness import DPRandomness
from .privacy.sampler import ExampleBatchCollator, PoissonBatchSampler, SamplerEpochCallback, ShuffledBatchSampler
from .privacy.validation import check_model_is_privatizable, check_train_dataset
from .resume import finish_without_training, is_finished
from .scope import block_stack_name, describe_trainable, phase_scopes
from .trainer_saving import DPSavingMixin

logger = logging.get_logger(__name__)

class DPTrainer(DPSavingMixin, Trainer):
    """A `transformers.Trainer` that trains with DP-SGD as configured by `DPTrainingArguments`.

    Takes the same arguments as `Trainer`. The training loss logged by the Trainer is computed on private
    data and is not covered by the DP guarantee (which covers the weights); ε is logged as `epsilon`.
    """

    def __init__(self, model=None, args: DPTrainingArguments | None = None, train_dataset=None, peft_config=None,
                 **kwargs):
        if not isinstance(args, DPTrainingArguments):
            raise TypeError("DPTrainer: `args` must be a DPTrainingArguments (it holds the privacy budget).")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                "DPTrainer: compute_loss_func returns a batch loss; DP-SGD needs one loss per example. "
                "Subclass DPTrainer and override `per_example_loss(outputs, labels)` instead."
            )
        check_hub_strategy(args)  # again: set_push_to_hub() bypasses the arguments' own check
        if train_dataset is not None:
            check_train_dataset(train_dataset, args.target_delta)
        if peft_config is not None:
            if model is None:
                raise ValueError("DPTrainer: peft_config needs a model to wrap.")
            from .lora import apply_peft_config

            model = apply_peft_config(model, peft_config)
        elif model is not None and hasattr(model, "peft_config"):
            from .lora import check_peft_model

            check_peft_model(model)
        if model is not None:
            check_model_is_privatizable(model)
        self._scopes = (phase_scopes(model, args.trainable_blocks, args.lp_steps, args.block_stack)
                        if model is not None else [])
        if self._scopes:
            self._scopes[-1].apply(model)
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        self.ledger: PrivacyLedger | None = None
        self._plan: PrivacyLedger | None = None
        self._applied_phase: int | None = None
        self._cached_head: str | None = None  # name of the head module trained on cached inputs, if any
        self._cached_inputs = None
        self._dp_optimizer = None
        self._grad_sample_hooks = None
        self._ghost_engine: GhostClippingEngine | None = None
        self.clipping_engine: str | None = None  # the engine that ran: "ghost" or "hooks"
        self._batch_sampler = None
        self._resume_ledger: PrivacyLedger | None = None
        self._epsilon_cache: tuple[int, float] | None = None
        self._randomness: DPRandomness | None = None  # the run's secret; made fresh by every train()
        self._shifts_labels = is_causal_lm(self.model)
        self.add_callback(SamplerEpochCallback(lambda: self._batch_sampler))
        for cb in self.callback_handler.callbacks:  # e.g. RepresentationLawCallback needs the model and collator
            if hasattr(cb, "attach"):
                cb.attach(self)

    # ---- the privacy plan -------------------------------------------------------------------------
    def privacy_plan(self) -> PrivacyLedger:
        """The ledger this run will fill: its phases (sample rate, steps, σ calibrated if a target ε is set)."""
        if self._plan is None:
            self._plan = plan_run(self.args, len(self.train_dataset))
        return self._plan

    # ---- data: Poisson logical batches --------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset.")
        args = self.args
        if self._cached_head is not None:
            dataset, collator = self._cached_inputs, default_data_collator
        else:
            dataset, collator = self._train_dataset_and_collator()
        n = len(dataset)
        plan = self.privacy_plan()
        batch = plan.phases[-1].expected_batch_size
        common = dict(num_samples=n, steps_per_epoch=max(1, n // batch),
                      micro_batches_per_step=args.gradient_accumulation_steps, world_size=args.world_size,
                      rank=args.process_index, seed=self._randomness.sampling_seed())
        if args.poisson_sampling:
            self._batch_sampler = PoissonBatchSampler(sample_rate=plan.sample_rate_at, secure=args.secure_mode,
                                                      **common)
        else:
            self._batch_sampler = ShuffledBatchSampler(batch_size=batch, **common)
        # Not passed through accelerate.prepare: sharding would re-split our (already per-rank) batches.
        return DataLoader(dataset, batch_sampler=self._batch_sampler, collate_fn=ExampleBatchCollator(collator),
                          num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory)

    def _train_dataset_and_collator(self):
        dataset, collator = self.train_dataset, self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        return dataset, collator

    # ---- optimizer: Opacus hooks + DP optimizer -------------------------------------------------------
    def create_optimizer(self, model=None):
        if self._dp_optimizer is not None and self.optimizer is self._dp_optimizer:
            self._attach_hooks()
            return self.optimizer
        if self._scopes:  # the optimizer and hooks cover every phase's scope; each phase then freezes the rest
            self._scopes[-1].apply(self.model)
        super().create_optimizer(model)
        plan = self.privacy_plan()
        self.ledger = plan if self._resume_ledger is None else resume_ledger(plan, self._resume_ledger,
                                                                             self.state.global_step)
        self._attach_hooks()
        self._dp_optimizer = MicroBatchDPOptimizer(
            self.optimizer, clipping=self.args.clipping, noise_multiplier=self.ledger.noise_multiplier,
            max_grad_norm=self.args.per_sample_max_grad_norm, expected_batch_size=self.ledger.expected_batch_size,
            noise_generator=lambda device: self._randomness.noise_generator(self.ledger.steps_done, device),
            world_size=self.args.world_size, rank=self.args.process_index, secure_mode=self.args.secure_mode,
            engine=self._ghost_engine,
        )
        self._dp_optimizer.attach_step_hook(lambda _opt: self.ledger.record_step())
        self.optimizer = self._dp_optimizer
        self._announce_plan()
        self._applied_phase = None
        self._sync_phase()
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """With a linear-probing phase: a constant `lp_learning_rate` for it, then the configured schedule over
        the fine-tuning steps alone."""
        plan = self.privacy_plan()
        if len(plan.phases) == 1 or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        lp_steps = plan.phases[0].steps
        base = super().create_scheduler(num_training_steps - lp_steps, optimizer)
        if not isinstance(base, torch.optim.lr_scheduler.LambdaLR):
            raise ValueError(f"DPTrainer: lr_scheduler_type={self.args.lr_scheduler_type!r} cannot be shifted past "
                             "the linear-probing phase; use a step-based schedule (linear, cosine, constant, ...).")
        lp_factor = (self.args.lp_learning_rate or self.args.learning_rate) / self.args.learning_rate
        lambdas = [lambda step, f=f: lp_factor if step < lp_steps else f(step - lp_steps) for f in base.lr_lambdas]
        for group in (optimizer or self.optimizer).param_groups:
            group["lr"] = group["initial_lr"]
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lambdas)
        return self.lr_scheduler

    def _sync_phase(self) -> None:
        """Train the scope of the phase the next step belongs to, with that phase's σ and expected batch."""
        index = self.ledger.phase_index()
        if index == self._applied_phase:
            return
        if len(self._scopes) > 1:
            # Hooks only on this phase's modules: a frozen module that gradients flow through (below a tied head)
            # must not compute per-sample gradients.
            self._scopes[index].apply(self.model)
            self._remove_hooks()
            self._attach_hooks()
        phase = self.ledger.phases[index]
        self._dp_optimizer.noise_multiplier = phase.noise_multiplier
        self._dp_optimizer.expected_batch_size = phase.expected_batch_size
        if self._applied_phase is not None:
            logger.warning(f"DP-SGD phase '{phase.name}' starts at step {self.ledger.steps_done}: σ="
                           f"{phase.noise_multiplier:.4f}, expected batch {phase.expected_batch_size}, "
                           f"training {self.describe_scope(index)}")
        self._applied_phase = index

    def describe_scope(self, phase: int | None = None) -> str:
        """What trains, in one line (for a phase index, or the whole run)."""
        if hasattr(self.model, "peft_config"):
            trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            return f"PEFT adapters ({type(self.model).__name__}): {trained:,} trainable parameters"
        if not self._scopes:
            return "all parameters"
        if phase is not None:
            return self._scopes[min(phase, len(self._scopes) - 1)].description
        if len(self._scopes) == 1:
            return self._scopes[0].description
        steps = [p.steps for p in self.privacy_plan().phases]
        return " then ".join(f"{s.description} for {t} steps" for s, t in zip(self._scopes, steps))

    def _choose_engine(self) -> str:
        """'ghost' when it supports the model (and was not refused), else 'hooks'; a fallback is logged."""
        requested = self.args.clipping_engine
        if requested == "hooks":
            return "hooks"
        unit = getattr(self.args, "privacy_unit", "row")
        reason = (f"privacy_unit={unit!r} clips the summed gradient of several rows" if unit != "row"
                  else unsupported_reason(self.model))
        if reason is None:
            return "ghost"
        if requested == "ghost":
            raise ValueError(f"DPTrainer: clipping_engine='ghost' cannot clip this model exactly: {reason}. "
                             "Use clipping_engine='hooks' (or 'auto').")
        logger.warning(f"DPTrainer: per-example clipping falls back to Opacus hooks (slower, more memory): {reason}.")
        return "hooks"

    def _attach_hooks(self) -> None:
        if self._grad_sample_hooks is not None or self._ghost_engine is not None:
            return
        for name, p in self.model.named_parameters():
            p._dp_name = name  # for error messages that name the parameter
        engine = self._choose_engine()
        if engine != self.clipping_engine:
            logger.warning(f"DPTrainer: clipping_engine={engine!r} (per-example clipping "
                           f"{'by ghost norms and book-keeping' if engine == 'ghost' else 'by Opacus hooks'}).")
        self.clipping_engine = engine
        if engine == "ghost":  # only modules that own a trained tensor are hooked (nothing below the scope)
            self._ghost_engine = GhostClippingEngine(self.model)
        else:
            self._grad_sample_hooks = GradSampleHooks(self.model, batch_first=True, loss_reduction="sum", strict=True)
        if self._dp_optimizer is not None:
            self._dp_optimizer.engine = self._ghost_engine

    def _remove_hooks(self) -> None:
        if self._grad_sample_hooks is not None:
            self._grad_sample_hooks.remove_hooks()
            self._grad_sample_hooks = None
        if self._ghost_engine is not None:
            self._ghost_engine.remove()
            self._ghost_engine = None

    def _detach_hooks(self) -> None:
        self._remove_hooks()
        for p in self.model.parameters():
            for attr in ("grad_sample", "summed_grad", "_forward_counter"):
                if hasattr(p, attr):
                    delattr(p, attr)

    def _announce_plan(self) -> None:
        if not self.is_world_process_zero():  # once, not once per process
            return
        led = self.ledger
        if led.randomness == "seeded":
            logger.warning(f"DPTrainer: noise_seed={self.args.noise_seed}. The noise and the batches are reproducible "
                           "from this seed: the run is NOT private against anyone who knows it. Use it for tests and "
                           "experiments only.")
        if led.noise_multiplier == 0:
            logger.warning("DPTrainer: noise_multiplier=0. This run is NOT differentially private (ε = ∞); "
                           "per-example clipping only, as a non-private reference.")
        if not led.poisson_sampling:
            logger.warning("DPTrainer: poisson_sampling=False. Batches are shuffled and fixed-size; the ε reported "
                           "is computed as if they were Poisson-sampled and is NOT a proven guarantee.")
        target = f"target ε={led.target_epsilon}" if led.target_epsilon is not None else "σ given"
        lines = [f"DP-SGD plan ({target}, δ={led.target_delta:g}, {led.neighboring} neighbours, accountant="
                 f"{led.accountant}, noise and batches from {led.randomness}, clipping={led.clipping} "
                 f"C={led.per_sample_max_grad_norm}, {led.dataset_size} examples): ε at the end of the plan "
                 f"{led.planned_epsilon():.4f}"]
        stack = block_stack_name(self.model, self.args.block_stack)
        for i, phase in enumerate(led.phases):
            lines.append(f"phase '{phase.name}': σ={phase.noise_multiplier:.4f}, sample rate q={phase.sample_rate:.5f} "
                         f"(expected batch {phase.expected_batch_size}), {phase.steps} steps; trains "
                         f"{self.describe_scope(i)}")
            params = (self._scopes[min(i, len(self._scopes) - 1)].parameters if self._scopes
                      else [p for p in self.model.parameters() if p.requires_grad])
            lines.append(describe_trainable(self.model, params, phase.noise_multiplier, led.per_sample_max_grad_norm,
                                            phase.expected_batch_size, stack))
        logger.warning("\n".join(lines))

    # ---- one micro-batch ----------------------------------------------------------------------------
    def per_example_loss(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """Loss of each example of the micro-batch, shape (batch,). Override for custom objectives."""
        return per_example_loss(outputs.logits, labels, shift_labels=self._shifts_labels,
                                label_smoothing=self.args.label_smoothing_factor)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        self._sync_phase()
        if not inputs:  # an empty Poisson micro-batch: it contributes nothing but the step still happens
            return torch.zeros((), device=self.args.device)
        model.train()
        scope = self._scopes[min(self._applied_phase or 0, len(self._scopes) - 1)] if self._scopes else None
        if scope is not None and scope.head_only:  # a linear probe: the frozen backbone in eval mode, as when cached
            set_probe_modes(self.model, scope.head_modules)
        inputs = self._prepare_inputs(inputs)
        if "labels" not in inputs:
            raise ValueError("DPTrainer: the batch has no `labels`; per-example losses need them.")
        labels = inputs.pop("labels")
        batch_position_ids(self.model, inputs)
        # No DDP gradient sync: it would all-reduce the unclipped gradient, which the DP optimizer discards (it
        # all-reduces the clipped, noised sum itself), and would hang when another rank's micro-batch is empty.
        recording = self._ghost_engine.recording() if self._ghost_engine is not None else contextlib.nullcontext()
        with self.accelerator.no_sync(model), recording:
            with self.compute_loss_context_manager():
                if self._cached_head is not None:
                    outputs = ModelOutput(logits=self.model.get_submodule(self._cached_head)(inputs["features"]))
                else:
                    outputs = model(**inputs)
                losses = self.per_example_loss(outputs, labels)
            self.accelerator.backward(losses.sum())
        self._dp_optimizer.accumulate_micro_batch()
        return losses.detach().mean() / self.current_gradient_accumulation_steps

    def _get_num_items_in_batch(self, batch_samples, device):
        # DP-SGD sums per-example losses itself; the Trainer's count would also crash on an empty micro-batch.
        return None

    # ---- run, log, save -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        self._resume_ledger = None
        self._plan = None
        self._randomness = DPRandomness(self.args.noise_seed, self.args.world_size)
        if self.train_dataset is not None:  # refuse packed rows before anything trains
            dataset, collator = self._train_dataset_and_collator()
            ExampleBatchCollator(collator)([dataset[i] for i in range(min(2, len(dataset)))])
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
            if is_finished(self._resume_ledger):
                return finish_without_training(self, path, self._resume_ledger)
        self._cached_head, self._cached_inputs, no_cache = prepare_cached_head(
            self.model, self._scopes, self.args, self.train_dataset, self._train_dataset_and_collator)
        if no_cache:
            logger.warning(f"DPTrainer: linear probe without cached features ({no_cache}); each step runs the "
                           "backbone.")
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
        privacy = {}
        if self.ledger is not None:
            privacy["epsilon"] = self.epsilon()
            if len(self.ledger.phases) > 1:
                privacy.update({f"epsilon_{name}": eps for name, eps in self.ledger.epsilon_by_phase().items()})
        logged = {**logs, **privacy}
        super().log(logged, *args, **kwargs)
        # What the Trainer adds in place (epoch) reaches the caller; ε does not: eval metrics that a hyperparameter
        # search scores must stay free of it.
        logs.update({k: v for k, v in logged.items() if k not in privacy})
