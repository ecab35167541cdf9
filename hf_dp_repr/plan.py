"""The privacy plan of a `DPTrainer` run, made from `DPTrainingArguments` before the first step: the logical
batch, the phases (one, or a linear probe then a fine-tune) and their σ, calibrated so that the whole planned
run spends exactly the target ε (a frozen `PrivacyPlan`; the run's `PrivacyLedger` then counts its steps); and
the check that a checkpoint's ledger belongs to the same plan.

Example:
    >>> from hf_dp_repr import DPTrainingArguments
    >>> from hf_dp_repr.plan import plan_run
    >>> args = DPTrainingArguments(output_dir="/tmp/plan-doc", target_epsilon=2.0, target_delta=1e-5,
    ...                            per_device_train_batch_size=100, max_steps=50, report_to="none")
    >>> plan = plan_run(args, dataset_size=10_000)
    >>> plan.phases[0].sample_rate, plan.planned_steps, round(plan.planned_epsilon(), 2)
    (0.01, 50, 2.0)
"""

from __future__ import annotations

import math

from .config import DPTrainingArguments
from .errors import DPConfigError
from .privacy.accounting import calibrate_last_phase, calibrate_noise_multiplier
from .privacy.ledger import Phase, PrivacyLedger, PrivacyPlan

# Plan fields that must match between a checkpoint and the resumed run, or the accounting would be wrong.
RESUME_INVARIANTS = ("accountant", "target_delta", "phases", "per_sample_max_grad_norm", "clipping", "dataset_size",
                     "world_size", "neighboring", "randomness", "privacy_unit")


def logical_batch(args: DPTrainingArguments, per_device: int, n: int) -> int:
    """Examples (units) per DP step: per-device batch × gradient accumulation × processes (at most `n`)."""
    batch = per_device * args.gradient_accumulation_steps * args.world_size
    if batch > n:
        raise DPConfigError(
            f"DPTrainer: the logical batch (per-device batch × gradient_accumulation_steps × processes = {batch}) "
            f"exceeds the {n} training {'examples' if args.privacy_unit == 'row' else 'units (' + args.privacy_unit + ')'}; "
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
    if not args.lp_steps:
        sigma = args.noise_multiplier
        if sigma is None:
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
        elif args.lp_epsilon_fraction is None:
            sigma1 = sigma2 = calibrate_last_phase(eps, delta, [(0.0, q1, lp_steps)], q2, ft_steps, acc,
                                                   same_sigma=True, neighboring=rel)
        else:
            sigma1 = calibrate_noise_multiplier(args.lp_epsilon_fraction * eps, delta, q1, lp_steps, acc, rel)
            sigma2 = calibrate_last_phase(eps, delta, [(sigma1, q1, lp_steps)], q2, ft_steps, acc, neighboring=rel)
        phases = (Phase("linear_probe", sigma1, q1, lp_steps, lp_batch),
                  Phase("fine_tune", sigma2, q2, ft_steps, batch))
    return PrivacyPlan(
        accountant=acc, target_delta=delta, per_sample_max_grad_norm=args.per_sample_max_grad_norm,
        clipping=args.clipping, dataset_size=n, poisson_sampling=args.poisson_sampling, phases=phases,
        target_epsilon=eps, world_size=args.world_size, neighboring=rel,
        randomness="os-entropy" if args.noise_seed is None else "seeded", privacy_unit=args.privacy_unit,
    )


def resume_ledger(plan: PrivacyPlan, checkpoint: PrivacyLedger, global_step: int) -> PrivacyLedger:
    """The checkpoint's ledger, if its plan is `plan` (on `RESUME_INVARIANTS`) and it belongs to the trainer state at
    `global_step`; else an error that lists what changed."""
    saved = checkpoint.plan
    changed = [f"{k}: checkpoint {getattr(saved, k)!r} vs now {getattr(plan, k)!r}"
               for k in RESUME_INVARIANTS if getattr(saved, k) != getattr(plan, k)]
    if changed:
        raise DPConfigError("DPTrainer: cannot resume, the privacy plan changed since the checkpoint "
                            "(resume with the same arguments and data):\n  " + "\n  ".join(changed))
    if checkpoint.steps_done != global_step:
        raise DPConfigError(f"DPTrainer: the checkpoint's ledger counts {checkpoint.steps_done} DP steps but its "
                            f"trainer state {global_step}; the checkpoint is inconsistent.")
    return checkpoint
