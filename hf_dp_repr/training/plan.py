"""The privacy plan of a `DPTrainer` run, made from `DPTrainingArguments` before the first step: the logical
batch, the phases (one, or a linear probe then a fine-tune) and their σ, calibrated so that the whole planned
run spends exactly the target ε, or meets a target attack rate (a frozen `PrivacyPlan`; the run's `PrivacyLedger`
then counts its steps); and the check that a checkpoint's ledger belongs to the same plan.

Example:
    >>> from hf_dp_repr import DPTrainingArguments
    >>> from hf_dp_repr.training.plan import plan_run
    >>> args = DPTrainingArguments(output_dir="/tmp/plan-doc", target_epsilon=2.0, target_delta=1e-5,
    ...                            per_device_train_batch_size=100, max_steps=50, report_to="none")
    >>> plan = plan_run(args, dataset_size=10_000)
    >>> plan.phases[0].sample_rate, plan.planned_steps, round(plan.planned_epsilon(), 2)
    (0.01, 50, 2.0)
"""

from __future__ import annotations

import math

import torch

from ..errors import DPConfigError
from ..privacy.accounting import calibrate_for_attack, calibrate_last_phase, calibrate_noise_multiplier
from ..privacy.adaptive_clipping import AdaptiveClipping, gradient_noise_multiplier
from ..privacy.attack_rates import AttackTarget
from ..privacy.engine import EngineOptions
from ..privacy.ledger import Phase, PrivacyLedger, PrivacyPlan
from .arguments import DPTrainingArguments

# Plan fields that must match between a checkpoint and the resumed run, or the accounting would be wrong.
RESUME_INVARIANTS = ("accountant", "target_delta", "target_attack_tpr_at_fpr", "phases", "per_sample_max_grad_norm",
                     "clipping", "dataset_size",
                     "world_size", "neighboring", "randomness", "privacy_unit", "adaptive_clipping")


def logical_batch(args: DPTrainingArguments, per_device: int, n: int) -> int:
    """Examples (units) per DP step: per-device batch × gradient accumulation × processes (at most `n`)."""
    batch = per_device * args.gradient_accumulation_steps * args.world_size
    if batch > n:
        raise DPConfigError(
            f"DPTrainer: the logical batch (per-device batch × gradient_accumulation_steps × processes = {batch}) "
            f"exceeds the {n} training "
            f"{'examples' if args.privacy_unit == 'row' else 'units (' + args.privacy_unit + ')'}; "
            "lower the batch size."
        )
    return batch


def plan_run(args: DPTrainingArguments, dataset_size: int) -> PrivacyPlan:
    """The plan of a run of `args` on `dataset_size` examples (units, with a privacy_unit column): every phase's σ,
    q and steps, and what ε is stated for."""
    n = dataset_size
    batch = logical_batch(args, args.per_device_train_batch_size, n)
    steps_per_epoch = max(1, n // batch)
    planned = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    eps, delta, acc, rel = args.target_epsilon, args.target_delta, args.accountant, args.neighboring
    attack = args.target_attack_tpr_at_fpr
    if not args.lp_steps:
        sigma = args.noise_multiplier
        if attack is not None:
            sigma = calibrate_for_attack(AttackTarget.parse(attack), [], batch / n, planned, rel)
        elif sigma is None:
            sigma = calibrate_noise_multiplier(eps, delta, batch / n, planned, acc, rel)
        phases = (Phase("train", sigma, batch / n, planned, batch),)
    else:
        lp_steps = round(args.lp_steps * planned) if args.lp_steps < 1 else int(args.lp_steps)
        if not 1 <= lp_steps < planned:
            raise DPConfigError(f"DPTrainer: lp_steps={args.lp_steps} gives {lp_steps} linear-probing steps out of "
                             f"{planned} planned; it must leave at least one step to each phase.")
        lp_batch = logical_batch(args, args.lp_per_device_train_batch_size or args.per_device_train_batch_size, n)
        q1, q2, ft_steps = lp_batch / n, batch / n, planned - lp_steps
        if args.noise_multiplier is not None:
            sigma1 = sigma2 = args.noise_multiplier
        elif attack is not None:  # one σ for both phases: there is no ε to split
            if args.lp_epsilon_fraction is not None:  # set after the arguments were checked (e.g. a sweep)
                raise DPConfigError(f"DPTrainer: lp_epsilon_fraction={args.lp_epsilon_fraction} splits target_epsilon, "
                                    "but σ is calibrated for target_attack_tpr_at_fpr: drop lp_epsilon_fraction.")
            sigma1 = sigma2 = calibrate_for_attack(AttackTarget.parse(attack), [(0.0, q1, lp_steps)], q2, ft_steps,
                                                   rel, same_sigma=True)
        elif args.lp_epsilon_fraction is None:
            sigma1 = sigma2 = calibrate_last_phase(eps, delta, [(0.0, q1, lp_steps)], q2, ft_steps, acc,
                                                   same_sigma=True, neighboring=rel)
        else:
            sigma1 = calibrate_noise_multiplier(args.lp_epsilon_fraction * eps, delta, q1, lp_steps, acc, rel)
            sigma2 = calibrate_last_phase(eps, delta, [(sigma1, q1, lp_steps)], q2, ft_steps, acc, neighboring=rel)
        phases = (Phase("linear_probe", sigma1, q1, lp_steps, lp_batch),
                  Phase("fine_tune", sigma2, q2, ft_steps, batch))
    check_signal_survives(phases, args, n)
    adaptive = None
    if args.adaptive_clipping is not None:  # σ_b fixed now; each phase's σ must leave the gradient its share
        adaptive = AdaptiveClipping.parse(args.adaptive_clipping).resolved(
            phases[-1].expected_batch_size, max(p.noise_multiplier for p in phases))
        for phase in phases:
            gradient_noise_multiplier(phase.noise_multiplier, adaptive.count_noise)
    return PrivacyPlan(
        accountant=acc, target_delta=delta, per_sample_max_grad_norm=args.per_sample_max_grad_norm,
        clipping=args.clipping, dataset_size=n, poisson_sampling=args.poisson_sampling, phases=phases,
        target_epsilon=eps, world_size=args.world_size, neighboring=rel,
        randomness="os-entropy" if args.noise_seed is None else "seeded", privacy_unit=args.privacy_unit,
        target_attack_tpr_at_fpr=None if attack is None else str(AttackTarget.parse(attack)),
        adaptive_clipping=adaptive,
    )


# σ / expected batch at which the plan is refused: the noise's std in each coordinate of the averaged update (σC/B) is
# then at least this many times the largest norm the averaged clipped gradient can have (C).
NOISE_DOMINATED = 10.0


def check_signal_survives(phases, args: DPTrainingArguments, n: int) -> None:
    """Refuse (unless `allow_noise_dominated`) a budget whose calibrated σ is so large against its expected batch
    that no update can carry signal: σ·C/B ≥ NOISE_DOMINATED·C. Names the fixes: a larger batch, fewer steps, a
    larger ε. A σ given as `noise_multiplier` is the user's own choice (tests of the noise use σ ≫ B on purpose)."""
    if args.noise_multiplier is not None:
        return
    for phase in phases:
        ratio = phase.noise_multiplier / max(phase.expected_batch_size, 1)
        if ratio < NOISE_DOMINATED or args.allow_noise_dominated:
            continue
        attack = args.target_attack_tpr_at_fpr
        target, larger = ((f"target_epsilon={args.target_epsilon}", "target_epsilon") if attack is None else
                          (f"target_attack_tpr_at_fpr={attack}", "target TPR"))
        raise DPConfigError(
            f"DPTrainer: phase '{phase.name}': {target} over {phase.steps} steps gives σ={phase.noise_multiplier:.4g} "
            f"on an expected batch of {phase.expected_batch_size} (of {n}): the noise's std in every coordinate of "
            f"the averaged update, σ·C/B = {ratio:.3g}·C, is at least {NOISE_DOMINATED:g}× the largest norm the "
            "clipped signal can have (C), so training would follow noise. Fixes: a larger batch "
            "(per_device_train_batch_size × gradient_accumulation_steps; σ grows more slowly than the batch), fewer "
            f"steps (max_steps / num_train_epochs), or a larger {larger}; set allow_noise_dominated=True to train "
            "anyway.")


def engine_options(args: DPTrainingArguments, sharded: bool = False) -> EngineOptions:
    """How the run's `DPEngine` runs: the arguments that do not change ε (so are not in the plan); `sharded`: the
    model is sharded by FSDP2 (the "fsdp2" reduction)."""
    return EngineOptions(clipping_engine=args.clipping_engine, secure_mode=args.secure_mode,
                         max_rows_per_unit=args.max_rows_per_unit,
                         micro_batches_per_step=args.gradient_accumulation_steps, rank=args.process_index,
                         reduction="fsdp2" if sharded else "ddp", views_per_example=args.augmentation_multiplicity)


def resume_ledger(plan: PrivacyPlan, checkpoint: PrivacyLedger, global_step: int, saved_args: dict | None = None,
                  args: dict | None = None) -> PrivacyLedger:
    """The checkpoint's ledger, if its plan is `plan` (on `RESUME_INVARIANTS`) and it belongs to the trainer state at
    `global_step`; else an error with one line per change: each changed argument (`saved_args`, `args`: the
    checkpoint's and the current arguments as dicts, when known) or else each changed plan field."""
    refused = plan_changes(checkpoint.plan, plan, saved_args, args)
    if saved_args is not None and args is not None:
        refused += [f"{c} changes what trains (the checkpoint's optimizer state is for the old one): refused"
                    for c in (_change(k, saved_args, args) for k in SCOPE_ARGUMENTS) if c]
    if refused:
        what = "the privacy plan" if "privacy plan" in refused[0] else "what trains"
        raise DPConfigError(f"DPTrainer: cannot resume, {what} changed since the checkpoint:\n  "
                            + "\n  ".join(refused) + "\nFix: resume with the checkpoint's values of these arguments "
                            "and the same data, or start a new run (another output_dir, or overwrite_output_dir in "
                            "the recipes) with its own budget.")
    if checkpoint.steps_done != global_step:
        raise DPConfigError(f"DPTrainer: the checkpoint's ledger counts {checkpoint.steps_done} DP steps but its "
                            f"trainer state {global_step}; the checkpoint is inconsistent.")
    return checkpoint


# ---- what a resume may and may not change ---------------------------------------------------------------
# Arguments the plan is made of (with the dataset size and the number of processes).
PLAN_ARGUMENTS = ("target_epsilon", "target_attack_tpr_at_fpr", "target_delta", "noise_multiplier", "accountant",
                  "neighboring", "per_sample_max_grad_norm", "clipping", "poisson_sampling", "noise_seed",
                  "privacy_unit", "adaptive_clipping",
                  "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "num_train_epochs",
                  "lp_steps", "lp_epsilon_fraction", "lp_per_device_train_batch_size")
# What trains: the checkpoint's optimizer state holds these parameters and no others.
SCOPE_ARGUMENTS = ("trainable_blocks", "trainable_groups", "block_stack", "optim")
# The optimizer and learning-rate schedule: the checkpoint's state continues, these arguments are set back to it.
CONTINUED_ARGUMENTS = ("learning_rate", "lp_learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
                       "warmup_ratio", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")
_SECRET = ("noise_seed",)  # changed or not, its values are never printed


def _change(name: str, saved: dict, now: dict) -> str | None:
    if name not in saved or name not in now or saved[name] == now[name]:
        return None
    return f"{name} changed" if name in _SECRET else f"{name} {saved[name]!r} → {now[name]!r}"


def plan_changes(saved: PrivacyPlan, plan: PrivacyPlan, saved_args: dict | None = None,
                 args: dict | None = None) -> list[str]:
    """One line per reason the plan `plan` is not the checkpoint's `saved` (empty if it is): the changed
    arguments when both argument dicts are known, the data size and processes, else the changed plan fields."""
    fields = [k for k in RESUME_INVARIANTS if getattr(saved, k) != getattr(plan, k)]
    if not fields:
        return []
    lines = []
    if "dataset_size" in fields:
        lines.append(f"the training set: {saved.dataset_size} → {plan.dataset_size} {saved.privacy_unit}s")
    if "world_size" in fields:
        lines.append(f"processes (world_size) {saved.world_size} → {plan.world_size}")
    if saved_args is not None and args is not None:
        epochs_matter = saved_args.get("max_steps", -1) <= 0 or args.get("max_steps", -1) <= 0
        lines += [c for c in (_change(k, saved_args, args) for k in PLAN_ARGUMENTS
                              if k != "num_train_epochs" or epochs_matter) if c]
    if not lines:  # no arguments recorded (an older checkpoint): the plan's own fields
        for k in fields:
            lines += (_phase_changes(saved.phases, plan.phases) if k == "phases" else
                      [f"{k} {getattr(saved, k)!r} → {getattr(plan, k)!r}"])
    return [f"{line} changes the privacy plan: refused" for line in lines]


def _phase_changes(saved, now) -> list[str]:
    if len(saved) != len(now):
        return [f"phases {[p.name for p in saved]} → {[p.name for p in now]}"]
    what = {"steps": "steps", "noise_multiplier": "σ", "sample_rate": "sample rate q",
            "expected_batch_size": "expected batch"}
    return [f"{label} of phase '{a.name}' {getattr(a, k)!r} → {getattr(b, k)!r}" for a, b in zip(saved, now)
            for k, label in what.items() if getattr(a, k) != getattr(b, k)]


def continued_arguments(saved_args: dict, args: dict) -> dict[str, str]:
    """{argument: its line} for each changed optimizer/schedule argument: the resumed run sets it back to the
    checkpoint's value (`saved_args[argument]`), as the checkpoint's optimizer and scheduler state continue."""
    return {k: f"{c}: ignored on resume (the checkpoint's optimizer and learning-rate schedule continue; start a new "
               "run to change it)" for k in CONTINUED_ARGUMENTS if (c := _change(k, saved_args, args))}


def probe_then_schedule(base, lp_steps: int, args: DPTrainingArguments, optimizer):
    """The learning-rate schedule of a run with a linear-probing phase: a constant `lp_learning_rate` for its
    `lp_steps`, then `base` (the configured schedule, made for the fine-tuning steps alone) shifted past them."""
    if not isinstance(base, torch.optim.lr_scheduler.LambdaLR):
        raise DPConfigError(f"DPTrainer: lr_scheduler_type={args.lr_scheduler_type!r} cannot be shifted past "
                            "the linear-probing phase; use a step-based schedule (linear, cosine, constant, ...).")
    lp_factor = (args.lp_learning_rate or args.learning_rate) / args.learning_rate
    lambdas = [lambda step, f=f: lp_factor if step < lp_steps else f(step - lp_steps) for f in base.lr_lambdas]
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
