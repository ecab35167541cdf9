"""Public → private continual training (seed 004) inside one `DPTrainer.train()`.

`DPTrainer(..., public_train_dataset=pub)` first trains non-privately on `pub` with a plain `transformers.Trainer`
on the same model (no clipping, no noise, nothing accounted: the data is public), then switches to DP-SGD on the
private `train_dataset`. The switch (`DPTrainingArguments.public_switch`):

- "fixed": after `public_max_steps` public steps;
- "decelerator": at the first check (every `public_check_steps` steps) where seed 004's decelerator
  D = σ²C²·tr(H)/B² of the planned DP phase is at most `decelerator_threshold` × ḡᵀHḡ, the curvature along the
  mean clipped gradient (tr(H) by Hutchinson at the upper end of its ± 2 standard errors, ḡ and H on a public
  batch; `continual.curvature`): a DP step at its best step size then keeps at least 1/(1 + threshold) of the
  non-private per-step loss decrease. Or at `public_max_steps`;
- "plateau": when the loss on `public_eval_dataset` has not improved for `public_plateau_patience` checks, or at
  `public_max_steps`.

Only the private phase is accounted: the ledger, σ, the Poisson batches and the noise are those of a DPTrainer
run without a public phase (its randomness is drawn from the same per-train() secret, which the public phase never
touches). The record (`continual_training.json`: switch step, criterion, tr(H), decelerator and ε over time) is
saved with the model and every checkpoint; a resumed run that finds it in its checkpoint skips the public phase
(its weights are in the checkpoint), so resuming across the switch gives the same ledger. Resuming from inside
the public phase is not supported: it starts again. `plot_continual(record)` draws the record.

The public Trainer's optimizer state is dropped at the switch (the DP phase builds its own optimizer).
"""

from __future__ import annotations

import json
import math
import os

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging

from ...errors import DPConfigError, LedgerError, UnsupportedError
from .curvature import clipped_gradient_terms, decelerator, decelerator_ratio, model_trace, public_batch

logger = logging.get_logger(__name__)
RECORD_FILE = "continual_training.json"
SWITCHES = ("fixed", "decelerator", "plateau")


class _SwitchCallback(TrainerCallback):
    """Every `check_steps` public steps: tr(H), the decelerator and its ratio (and the public eval loss); stops the
    public Trainer when the criterion is met."""

    def __init__(self, args, plan, batch, record):
        self.args, self.plan, self.batch, self.record = args, plan, batch, record
        self.best, self.stale = math.inf, 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step % self.args.public_check_steps and step != 1:
            return control
        gen = torch.Generator().manual_seed(step)
        trace, stderr = model_trace(model, self.batch, self.args.hessian_probes, gen)
        phase = self.plan.phases[0]
        entry = dict(phase="public", step=step, hessian_trace=trace, hessian_trace_stderr=stderr,
                     decelerator=decelerator(trace, phase.noise_multiplier, self.plan.per_sample_max_grad_norm,
                                             phase.expected_batch_size))
        if self.args.public_switch == "decelerator":
            first, along = clipped_gradient_terms(model, self.batch, self.plan.per_sample_max_grad_norm)
            entry["first_order_decrease"], entry["curvature_along_gradient"] = first, along
            # the upper end of tr(H)'s ~95 % interval: a noisy estimate (near an indefinite Hessian) does not switch
            entry["decelerator_ratio"] = decelerator_ratio(
                max(0.0, trace + 2 * stderr), along, noise_multiplier=phase.noise_multiplier,
                max_grad_norm=self.plan.per_sample_max_grad_norm, expected_batch=phase.expected_batch_size)
            if entry["decelerator_ratio"] <= self.args.decelerator_threshold:
                control.should_training_stop = True
        self.record["history"].append(entry)
        logger.warning("public step %d: tr(H) = %.4g ± %.2g, decelerator σ²C²tr(H)/B² = %.4g%s", step, trace, stderr,
                       entry["decelerator"], f", ratio {entry['decelerator_ratio']:.3g}"
                       if "decelerator_ratio" in entry else "")
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None or self.args.public_switch != "plateau":
            return control
        self.record["history"].append(dict(phase="public", step=state.global_step, public_eval_loss=loss))
        if loss < self.best - 1e-4:
            self.best, self.stale = loss, 0
        else:
            self.stale += 1
            if self.stale >= self.args.public_plateau_patience:
                control.should_training_stop = True
        return control


def run_public_phase(trainer, public_train, public_eval=None) -> dict:
    """Train `trainer.model` non-privately on `public_train` until the switch; returns the record."""
    args = trainer.args
    plan = trainer.privacy_plan()  # σ, B of the DP phase: from the arguments and n only
    record = dict(switch=args.public_switch, public_examples=len(public_train), history=[])
    probe_data = public_eval if public_eval is not None else public_train
    device = args.device
    batch = public_batch(probe_data, args.hessian_max_examples, trainer.data_collator, device)
    plateau = args.public_switch == "plateau"
    public_args = TrainingArguments(
        output_dir=os.path.join(args.output_dir, "public_phase"), max_steps=args.public_max_steps,
        per_device_train_batch_size=args.public_per_device_train_batch_size or args.per_device_train_batch_size,
        learning_rate=args.public_phase_learning_rate or args.learning_rate, optim=args.optim,
        weight_decay=args.weight_decay, lr_scheduler_type="constant", seed=args.seed, report_to="none",
        save_strategy="no", logging_steps=args.public_check_steps, disable_tqdm=args.disable_tqdm,
        use_cpu=args.use_cpu, bf16=args.bf16, remove_unused_columns=args.remove_unused_columns,
        eval_strategy="steps" if plateau else "no", eval_steps=args.public_check_steps if plateau else None,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
    )
    public = Trainer(model=trainer.model, args=public_args, train_dataset=public_train,
                     eval_dataset=public_eval if plateau else None, data_collator=trainer.data_collator,
                     callbacks=[_SwitchCallback(args, plan, batch, record)])
    result = public.train()
    record["switch_step"] = public.state.global_step
    record["public_train_loss"] = result.training_loss
    logger.warning("DPTrainer: switching from public (non-private) training to DP-SGD after %d public steps (%s)",
                   record["switch_step"], args.public_switch)
    trainer.model.train()
    return record


class PrivatePhaseCurvature(TrainerCallback):
    """During the DP phase: tr(H) on the public probe batch (post-processing of the DP weights on public data) and
    ε, every `public_check_steps` steps, appended to the record with steps counted after the switch."""

    def __init__(self, trainer, record, batch):
        self.trainer, self.record, self.batch = trainer, record, batch

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % args.public_check_steps:
            return control
        gen = torch.Generator().manual_seed(10**6 + state.global_step)
        trace, stderr = model_trace(self.trainer.model, self.batch, args.hessian_probes, gen,
                                    self.trainer.engine.clipper)
        plan = self.trainer.ledger.plan
        phase = plan.phases[-1]
        self.record["history"].append(dict(
            phase="private", step=self.record["switch_step"] + state.global_step, private_step=state.global_step,
            hessian_trace=trace, hessian_trace_stderr=stderr, epsilon=self.trainer.epsilon(),
            decelerator=decelerator(trace, phase.noise_multiplier, plan.per_sample_max_grad_norm,
                                    phase.expected_batch_size)))
        return control


def save_record(record: dict, directory: str) -> str:
    path = os.path.join(directory, RECORD_FILE)
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=lambda x: None)
    return path


def load_record(directory: str) -> dict | None:
    path = os.path.join(directory, RECORD_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def plot_continual(record: dict, path: str) -> str:
    """tr(H), the decelerator and ε over public then private steps, with the switch marked; saved as `path`."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.2))
    axes = fig.subplots(1, 3)
    hist = [h for h in record["history"] if "hessian_trace" in h]
    for ax, key, label in zip(axes, ("hessian_trace", "decelerator", "epsilon"),
                              ("tr(H) (public batch)", "σ²C²tr(H)/B²", "ε spent")):
        pts = [(h["step"], h[key]) for h in hist if h.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3)
        ax.axvline(record.get("switch_step", 0), color="gray", ls="--", label="switch to DP-SGD")
        ax.set_xlabel("step (public, then private)")
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def check_public_phase(args, train_dataset, public_train, public_eval) -> None:
    """Refuse, before any work, a public phase that cannot run as asked."""
    if public_train is None:
        if args.public_max_steps:
            raise DPConfigError("DPTrainer: public_max_steps is set but no public_train_dataset was given; pass "
                                "DPTrainer(..., public_train_dataset=...) or drop public_max_steps.")
        return
    if public_train is train_dataset:
        raise DPConfigError("DPTrainer: public_train_dataset is the private train_dataset; it would be trained on "
                            "without privacy. Give disjoint public data.")
    if args.public_max_steps < 1 and args.probe_preconditioning == "none":  # (else only the statistics' source)
        raise DPConfigError("DPTrainer: a public_train_dataset needs public_max_steps >= 1 (the switch step for "
                            "public_switch='fixed', the most public steps otherwise).")
    if args.public_switch == "plateau" and public_eval is None:
        raise DPConfigError("DPTrainer: public_switch='plateau' needs a public_eval_dataset (held-out PUBLIC data).")
    if args.world_size > 1 and args.public_max_steps:  # (probe_preconditioning alone runs on every process)
        raise UnsupportedError("DPTrainer: public → private training in one train() runs in a single process "
                               "for now; with several processes, pre-train on the public data first (the recipes' "
                               "--public_fraction) and pass the model to DPTrainer.")


def start_continual(trainer, checkpoint: str | None) -> None:
    """Run the public phase, or, resuming from a DP checkpoint that carries its record, skip it."""
    record = load_record(checkpoint) if checkpoint else None
    if checkpoint and record is None:
        raise LedgerError(f"DPTrainer: checkpoint {checkpoint} has no {RECORD_FILE}: it was not written after a "
                          "public phase. Resume it without public_train_dataset, or start again.")
    if record is None:
        record = run_public_phase(trainer, trainer.public_train_dataset, trainer.public_eval_dataset)
    else:
        logger.warning("DPTrainer: resuming after the switch (public phase of %d steps done, in the checkpoint)",
                       record["switch_step"])
    trainer.continual_record = record
    if not any(isinstance(cb, PrivatePhaseCurvature) for cb in trainer.callback_handler.callbacks):
        probe = trainer.public_eval_dataset if trainer.public_eval_dataset is not None else trainer.public_train_dataset
        batch = public_batch(probe, trainer.args.hessian_max_examples, trainer.data_collator, trainer.args.device)
        trainer.add_callback(PrivatePhaseCurvature(trainer, record, batch))


def finish_record(trainer) -> None:
    """The final ε into the record; the record and its plot into output_dir (main process)."""
    record = trainer.continual_record
    record["private_steps"] = trainer.ledger.steps_done
    record["epsilon"] = trainer.epsilon()
    if trainer.args.should_save:
        os.makedirs(trainer.args.output_dir, exist_ok=True)
        save_record(record, trainer.args.output_dir)
        plot_continual(record, os.path.join(trainer.args.output_dir, "continual_training.png"))
