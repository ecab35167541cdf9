"""`DPTrainer`: DP-SGD inside `transformers.Trainer`.

What changes against the plain Trainer, and nothing else:
- DP-SGD: one object, `trainer.engine` (`privacy.engine.DPEngine`), made from the run's frozen `PrivacyPlan` when
  training starts: Poisson batches, per-example clipping on the unwrapped HF model (so what is saved is a plain HF
  model), noise once per logical step from the run's secret, the `PrivacyLedger` stepped at every update;
- loss: the sum of per-example losses (`privacy.loss`), overridable through `per_example_loss`;
- accounting: `epsilon` in every log, the ledger in every checkpoint and restored by `resume_from_checkpoint`;
- what trains: each phase's scope (`scope.phases`), on features cached from frozen weights (`trainer.features`).
The private `Trainer` members it overrides or relies on are listed in `training.hf_compat`. Each `Trainer` member
it overrides is defined once: here (building the run and training it) or in its base class,
`trainer_outputs.DPTrainerOutputs` (what leaves or re-enters a run: logs, evaluation, saves, loads, pushes, search).

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
import os

import datasets
import torch
from torch.utils.data import DataLoader
from transformers.utils import logging

from ..data.images import interpolate_positions
from ..errors import ArgumentError, ArgumentTypeError, DataError, DPConfigError, UnsupportedError
from ..hub.card import ModelCardInfo
from ..privacy.augmentation import ViewsBatchSampler, ViewsDataset
from ..privacy.engine import DPEngine
from ..privacy.ledger import PrivacyLedger, PrivacyPlan
from ..privacy.loss import is_causal_lm
from ..privacy.randomness import DPRandomness
from ..privacy.sampler import UNIT_KEY, ExampleBatchCollator, SamplerEpochCallback
from ..privacy.sharding import is_sharded
from ..privacy.units import ROW, UnitRowsDataset, column_values, unit_rows
from ..privacy.validation import check_model_is_privatizable, check_train_dataset
from ..scope.head_init import init_head
from ..scope.lora import has_peft_adapters
from ..scope.phases import phase_scopes
from ..scope.prefix_cache import STATES_KEY
from . import TRAINER_LOGGER
from .accuracy_checks import check_views
from .arguments import DPTrainingArguments, check_hub_strategy
from .arguments.checks import check_fresh_model, check_one_run
from .arguments.fields import check_refused_fields, train_dataloader_options
from .averaging import averaging_note, finish_average, start_average
from .cached_features import FeatureCaches
from .checkpoints.output_dir import check_writable
from .checkpoints.resume import checkpoint_to_resume, finish_without_training, is_finished, prepare_resume
from .checkpoints.saving import missing_folders, record_spent, start_spent_record
from .continual.public_phase import check_public_phase, finish_record, start_continual
from .data_checks import check_labels, check_train_inputs
from .eval_overlap import check_eval_overlap
from .example_losses import DPExampleLossMixin
from .hp_search.trials import check_not_tuned_on
from .overrides import check_loss_overrides
from .plan import engine_options, plan_run, probe_then_schedule, resume_ledger
from .preconditioned_probe import check_preconditioning, finish_preconditioning, start_preconditioning
from .privacy_report import announce_plan, announce_spent, follow_log_level
from .sharding import check_trainer, shard_for_training, trainer_init
from .start_checks import StartChecks
from .trainer_outputs import DPTrainerOutputs

logger = logging.get_logger(TRAINER_LOGGER)

class DPTrainer(DPExampleLossMixin, DPTrainerOutputs):
    """A `transformers.Trainer` that trains with DP-SGD as configured by `DPTrainingArguments`.

    Takes the same arguments as `Trainer`, and `model_card_info` (a `ModelCardInfo`: what the DP model card says
    about the data and the base model). The training loss logged by the Trainer is computed on private data and is
    not covered by the DP guarantee (which covers the weights); ε is logged as `epsilon`. `engine` is the run's
    `DPEngine` (None before training).

    Custom objectives: override `per_example_loss(outputs, labels)` (one loss per example); a subclass overriding
    `compute_loss` is refused, since training never calls it (`training.overrides`: a class whose compute_loss is for
    evaluation only sets `compute_loss_handled = True` in its body).
    """

    def __init__(self, model=None, args: DPTrainingArguments | None = None, train_dataset=None, peft_config=None,
                 model_card_info: ModelCardInfo | dict | None = None, public_train_dataset=None,
                 public_eval_dataset=None, **kwargs):
        if not isinstance(args, DPTrainingArguments):
            raise ArgumentTypeError("DPTrainer: `args` must be a DPTrainingArguments (it holds the privacy budget).")
        check_loss_overrides(type(self), DPTrainer)  # a compute_loss override would be silently ignored
        if kwargs.get("compute_loss_func") is not None:
            raise DPConfigError(
                "DPTrainer: compute_loss_func returns a batch loss; DP-SGD needs one loss per example. "
                "Subclass DPTrainer and override `per_example_loss(outputs, labels)` instead."
            )
        check_hub_strategy(args)  # again: set_push_to_hub() bypasses the arguments' own check
        check_one_run(args.world_size)  # again: accelerate's state may have been set up anew since the arguments
        check_refused_fields(args)  # and fields set after the arguments were built
        check_public_phase(args, train_dataset, public_train_dataset, public_eval_dataset)
        self.public_train_dataset, self.public_eval_dataset = public_train_dataset, public_eval_dataset
        self.continual_record: dict | None = None  # public → private: switch step, tr(H), decelerator, ε
        self.engine: DPEngine | None = None  # the run's DP machinery, made when training starts
        self._unit_rows: tuple | None = None  # (each row's unit index, number of units) with a privacy_unit column
        if train_dataset is not None:
            check_train_dataset(train_dataset, args.target_delta, lambda: self._read_units(train_dataset, args),
                                args.allow_large_delta)
        if peft_config is not None:
            if model is None:
                raise ArgumentError("DPTrainer: peft_config needs a model to wrap.")
            from ..scope.lora import apply_peft_config

            model = apply_peft_config(model, peft_config)
        elif model is not None and has_peft_adapters(model):
            from ..scope.lora import check_peft_model

            check_peft_model(model)
        if model is not None:
            check_model_is_privatizable(model)
            init_head(model, args.head_init)
            interpolate_positions(model)  # a ViT on images of another size than its config's (data.images)
        model = shard_for_training(model, args, logger)  # fsdp, or a model sharded at load (training.sharding)
        self.sharded = is_sharded(model)
        self._set_scopes(model, args)
        # output_dir is checked writable now, not at the first save after training; the Trainer's `__init__` makes
        # it, but a refusal before the work starts must leave nothing behind: it is made when training starts.
        made = missing_folders(args.output_dir) if args.should_save else []
        if args.should_save:
            check_writable(args.output_dir)
        with trainer_init(args, self.sharded):
            super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        for folder in made:  # deepest first; only those still empty
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        check_trainer(self)
        # DP-SGD sums per-example losses itself: the Trainer must not count the batch's items (`hf_compat`)
        self.model_accepts_loss_kwargs = False
        self.model_card_info = ModelCardInfo.from_value(model_card_info)  # written by model_card.write_model_card
        self.run_hooks: list = []  # called as hook(self, "complete" | "failed") when a train() ends (e.g. a search's)
        follow_log_level(self.args)
        check_eval_overlap(self)
        self._plan: PrivacyPlan | None = None
        self.plan_notes: list[str] = []  # lines the logged plan ends with (a recipe's: its data notes, its defaults)
        self.features = FeatureCaches()  # features cached from frozen weights (training/cached_features.py)
        self._resume_ledger: PrivacyLedger | None = None
        self._several_rows = frozenset()  # modules with several rows per example (the start-of-training probe's)
        self.start_checks = StartChecks()  # the probe, once per model and collator; its cost in the plan line
        self._shifts_labels = is_causal_lm(self.model)
        self.add_callback(SamplerEpochCallback(lambda: None if self.engine is None else self.engine.sampler))
        for cb in self.callback_handler.callbacks:  # e.g. RepresentationLawCallback needs the model and collator
            if hasattr(cb, "attach"):
                cb.attach(self)
        if train_dataset is not None and self.model is not None and self.batch_has_labels:
            check_labels(self.model, train_dataset)  # the batch's keys are checked by train(): the collator may change

    def call_model_init(self, trial=None):
        """The Trainer's, then `args.head_init` applied to the fresh model. During a hyperparameter search the
        trial's arguments are set after the model is made: its head_init is applied by `get_train_dataloader`."""
        model = super().call_model_init(trial)
        if getattr(self, "hp_search_backend", None) is None:
            init_head(model, self.args.head_init)
        return model

    # ---- what trains, and the privacy plan ----------------------------------------------------------------------
    def _set_scopes(self, model, args) -> None:
        """`model`'s phase scopes, the last applied (the optimizer covers all phases'; each phase freezes the rest)."""
        self._scopes = (phase_scopes(model, args.trainable_blocks, args.lp_steps, args.block_stack,
                                     args.trainable_groups) if model is not None else [])
        if self._scopes:
            self._scopes[-1].apply(model)
        self._scoped_model = model

    def _read_units(self, dataset, args) -> int | None:
        """With a privacy_unit column: read it (before the Trainer removes unused columns) and return U."""
        self._unit_rows = None
        if args.privacy_unit == ROW:
            return None
        self._unit_rows = unit_rows(column_values(dataset, args.privacy_unit))
        return self._unit_rows[1]

    def privacy_plan(self) -> PrivacyPlan:
        """What this run will do: its phases (sample rate, steps, σ calibrated if a target ε is set), frozen; the
        steps taken are counted by `self.ledger`."""
        if self._plan is None:
            n = len(self.train_dataset) if self._unit_rows is None else self._unit_rows[1]
            self._plan = plan_run(self.args, n)
        return self._plan

    # ---- data: Poisson logical batches --------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """The first thing the Trainer's loop asks for: a model made by model_init (a search trial's, with the
        trial's arguments now set) gets its head_init and scope; the features are cached; the engine is made
        from the plan; its sampler draws the batches."""
        if self.train_dataset is None:
            raise DataError("DPTrainer: training requires a train_dataset.")
        if self.model is not self._scoped_model:  # what trains is decided again for a fresh model
            check_model_is_privatizable(self.model)
            if self.hp_search_backend is not None:  # a trial's (call_model_init ran before its arguments were set)
                init_head(self.model, self.args.head_init)
            self._set_scopes(self.model, self.args)
        units = self._unit_rows is not None
        views = check_views(self.args, self.train_dataset)  # augmentation_multiplicity: k fresh views per example
        start_preconditioning(self)  # probe_preconditioning: fitted on the public set, in front of the head
        if not self.features.ready:  # (sharded: none; cached parts would run outside the sharded root's forward)
            self.features.prepare(self.model, [] if units or self.sharded or views > 1 else self._scopes, self.args,
                                  self.train_dataset, self._train_dataset_and_collator)
        dataset, collator = self.features.train_inputs(self._train_dataset_and_collator)
        if self.engine is None:  # the run's secret is drawn now: fresh for every train()
            randomness = DPRandomness(self.args.noise_seed, self.args.world_size)
            self.engine = DPEngine(self.privacy_plan(), engine_options(self.args, self.sharded), randomness,
                                   log=logger)
        cached = self.features.cached_head is not None
        sampler = self.engine.batch_sampler(self._unit_rows[0] if units and not cached else None)
        if views > 1:  # each sampled row read k times through the dataset's transform, its views one unit
            dataset, sampler = ViewsDataset(dataset, self.args.seed), ViewsBatchSampler(sampler, views)
        if self.sharded:  # a rank whose micro-batch is empty runs this row, clip factor 0, to join the collectives
            self._stand_in = ExampleBatchCollator(collator)([dataset[0]])  # (views: one seeded view)
        # Not passed through accelerate.prepare: sharding would re-split our (already per-rank) batches.
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=ExampleBatchCollator(collator),
                          **train_dataloader_options(self.args))

    def _train_dataset_and_collator(self):
        dataset, collator = self.train_dataset, self.data_collator
        unit = self.args.privacy_unit
        if isinstance(dataset, datasets.Dataset):
            if unit != ROW and unit in dataset.column_names:  # consumed here, whatever remove_unused_columns says
                dataset = dataset.remove_columns(unit)
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if self._unit_rows is not None:
            dataset = UnitRowsDataset(dataset, self._unit_rows[0], unit)
        return dataset, collator

    # ---- optimizer: the engine's DP optimizer around the Trainer's --------------------------------------------
    def create_optimizer(self, model=None):
        engine = self.engine
        if engine is None:
            raise UnsupportedError("DPTrainer: the DP optimizer is made by train(), after its training dataloader.")
        if engine.optimizer is not None and self.optimizer is engine.optimizer:
            engine.attach(self.model)
            return self.optimizer
        if self._scopes:  # the optimizer and clipper cover every phase's scope; each phase then freezes the rest
            self._scopes[-1].apply(self.model)
        super().create_optimizer(model)
        ledger = None if self._resume_ledger is None else resume_ledger(engine.plan, self._resume_ledger,
                                                                          self.state.global_step)
        self.optimizer = engine.start(self.optimizer, self.model, ledger, several=self._several_rows)
        engine.after_step.append(lambda ledger: record_spent(self, ledger))
        record_spent(self)
        start_average(self)  # ema_decay: the average of what this optimizer trains (training.averaging)
        if self.is_world_process_zero():  # once, not once per process
            announce_plan(self.ledger, noise_seed=self.args.noise_seed, max_rows_per_unit=self.args.max_rows_per_unit,
                          model=self.model, block_stack=self.args.block_stack, describe_scope=self.describe_scope,
                          trained_params=self._trained_params, start_checks=self.start_checks.describe(),
                          notes=self.plan_notes)
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
        self.lr_scheduler = probe_then_schedule(base, lp_steps, self.args, optimizer or self.optimizer)
        return self.lr_scheduler

    def _sync_phase(self) -> None:
        """Train the scope of the phase the next step belongs to (the engine sets its σ and expected batch)."""
        first = self.engine.phase is None
        index = self.engine.enter_phase()
        if index is None:
            return
        if len(self._scopes) > 1:
            # The clipper only on this phase's modules: a frozen module that gradients flow through (below a tied
            # head) must not compute per-sample gradients.
            self._scopes[index].apply(self.model)
            self.engine.reattach(self.model)
        if not first:
            phase = self.engine.plan.phases[index]
            logger.info(f"DP-SGD phase '{phase.name}' starts at step {self.ledger.steps_done}: σ="
                        f"{phase.noise_multiplier:.4f}, expected batch {phase.expected_batch_size}, "
                        f"training {self.describe_scope(index)}")

    def _trained_params(self, phase: int) -> list:
        if self._scopes:
            return self._scopes[min(phase, len(self._scopes) - 1)].parameters
        return [p for p in self.model.parameters() if p.requires_grad]

    def describe_scope(self, phase: int | None = None) -> str:
        """What trains, in one line (for a phase index, or the whole run: then also what the released weights are)."""
        return self._scope_text(phase) + ("" if phase is not None else averaging_note(self.args))

    def _scope_text(self, phase: int | None) -> str:
        if has_peft_adapters(self.model):
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

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        self._sync_phase()
        stand_in = not inputs and self.sharded
        if stand_in:
            inputs = dict(self._stand_in)
        elif not inputs:  # an empty Poisson micro-batch: it contributes nothing but the step still happens
            return torch.zeros((), device=self.args.device)
        model.train()
        self.set_training_modes(self._scopes[min(self.engine.phase, len(self._scopes) - 1)] if self._scopes else None)
        states = inputs.pop(STATES_KEY, None)
        inputs = self._prepare_inputs(inputs)
        unit_ids = inputs.pop(UNIT_KEY, None)
        examples = self.examples_in_batch(inputs)
        # No DDP gradient sync: it would all-reduce the unclipped gradient, which the DP optimizer discards (it
        # all-reduces the clipped, noised sum itself), and would hang when another rank's micro-batch is empty.
        with self.accelerator.no_sync(model), self.engine.recording(examples):
            with self.compute_loss_context_manager():
                losses = self.example_losses(model, inputs, states=states)
            # the mean of an example's views (augmentation_multiplicity = k, else 1) is what is clipped
            self.accelerator.backward(losses.sum() / self.args.augmentation_multiplicity)
        self.engine.after_backward(self.row_units(inputs, unit_ids), stand_in)
        if stand_in:
            return torch.zeros((), device=self.args.device)
        return losses.detach().mean() / self.current_gradient_accumulation_steps

    # ---- run, log, save -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        check_not_tuned_on(self)  # not the data a search of this trainer tuned on (hp_search)
        self._resume_ledger = None
        self._plan = None
        check_one_run(self.args.world_size)
        check_eval_overlap(self)  # the eval set or the arguments may have changed since init
        if self.train_dataset is not None:  # before any work: labels, the model's inputs, rows that are not examples
            self._read_units(self.train_dataset, self.args)  # the dataset or arguments may have changed since init
            check_views(self.args, self.train_dataset)  # augmentation_multiplicity needs the dataset's transform
            check_preconditioning(self)  # probe_preconditioning: public data disjoint from the private set
            check_train_inputs(self)  # labels, then a collated probe batch: no packing, the model's inputs
            dataset, collator = self._train_dataset_and_collator()  # probed once per model and collator
            self._several_rows = self.start_checks.probe(self, dataset, collator,
                                                         self._scopes[-1] if self._scopes else None)
        if self.train_dataset is not None and trial is None:  # (a trial's arguments are set by the Trainer later)
            self.privacy_plan()  # refused (e.g. a batch larger than the data) before anything is written
        path = checkpoint_to_resume(self.args.output_dir, resume_from_checkpoint) if resume_from_checkpoint else None
        check_fresh_model(self, resuming=path is not None)
        if path is not None:
            self._resume_ledger = prepare_resume(self, path)  # plan/arguments checked, lost steps charged
            self.optimizer = None
            if is_finished(self._resume_ledger):
                return finish_without_training(self, path, self._resume_ledger)
        start_spent_record(self, resuming=path is not None)
        # public → private: the non-private phase first (or its record); with public_max_steps=0 the public set
        # only fits probe_preconditioning
        if self.public_train_dataset is not None and self.args.public_max_steps:
            start_continual(self, path)
        self.features.ready = False  # prepared with the training dataloader, on the model that trains
        self.weight_average = None  # made with the optimizer (ema_decay)
        self.engine = None  # a new run: its engine (and secret randomness) is made with its training dataloader
        state = "failed"
        try:
            output = super().train(resume_from_checkpoint=path, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            state = "complete"
            finish_average(self)  # ema_decay: the model holds the averaged weights from now on
        finally:
            if self.engine is not None:
                self.engine.detach(self.model)
            finish_preconditioning(self)  # the plain head, the public preconditioning folded into it
            for hook in self.run_hooks:
                hook(self, state)
        output.metrics["epsilon"] = self.epsilon()
        if self.is_world_process_zero():
            announce_spent(self.ledger)
        if self.continual_record is not None:
            finish_record(self)
        return output
