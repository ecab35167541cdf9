"""Checks of `DPTrainingArguments` fields, one function per feature (the privacy target, the unit of privacy, the
linear-probing phase, feature caching, report_to, several processes forming one run), run by
`DPTrainingArguments.__post_init__`; `check_privacy_unit` also by callers that set `privacy_unit` after parsing
(the causal-LM recipe). Each refuses before any work, naming the argument and the fix. Imports nothing heavy
(`hf-dp-repr privacy` checks --target-epsilon with it).

Several processes (accelerate launch, torchrun, MPI) must form one run:
    >>> from hf_dp_repr.training.arguments.checks import check_one_run, launched_processes
    >>> launched_processes()  # a process started alone
    1
    >>> check_one_run(world_size=1)  # what a launch of 2 processes seen as 1 would refuse (ProcessGroupError)
"""

from __future__ import annotations

import logging
import math
import os
import sys

from ...errors import DPConfigError, ProcessGroupError, UnsupportedError
from ...privacy.accounting import target_epsilon_problem
from ...privacy.adaptive_clipping import AdaptiveClipping

logger = logging.getLogger(__name__)
# How many processes a launcher started: torchrun and `accelerate launch` (WORLD_SIZE), MPI launchers (the variables
# accelerate reads for CPU runs).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


PRIVACY_TARGETS = ("target_epsilon", "target_attack_tpr_at_fpr", "noise_multiplier")  # give exactly one


def check_privacy_target(args) -> None:
    """Exactly one of `PRIVACY_TARGETS`, each with a value that can be met: a target ε, a target attack rate
    ("TPR@FPR", parsed into `args.attack_target`), or σ itself."""
    given = [name for name in PRIVACY_TARGETS if getattr(args, name) is not None]
    if len(given) > 1:
        raise DPConfigError(
            f"DPTrainingArguments: {' and '.join(given)} are {'both' if len(given) == 2 else 'all'} set. Give one: "
            "target_epsilon (σ calibrated to spend that ε), target_attack_tpr_at_fpr (σ calibrated so that no "
            "membership test beats that TPR at that FPR) or noise_multiplier (σ fixed).")
    if not given:
        raise DPConfigError(
            "DPTrainingArguments: none of target_epsilon, target_attack_tpr_at_fpr and noise_multiplier is set. Give "
            "target_epsilon (e.g. 8.0) or target_attack_tpr_at_fpr (e.g. '0.05@0.01') for a private run; for an "
            "explicitly non-private reference set noise_multiplier=0.")
    eps, sigma = args.target_epsilon, args.noise_multiplier
    if eps is not None and (problem := target_epsilon_problem(eps)):
        raise DPConfigError(f"DPTrainingArguments: {problem}")
    if sigma is not None and not (sigma >= 0 and math.isfinite(sigma)):
        raise DPConfigError(f"DPTrainingArguments: noise_multiplier must be >= 0 and finite, got {sigma}.")
    if args.target_attack_tpr_at_fpr is not None:
        from ...privacy.attack_rates import AttackTarget

        try:
            AttackTarget.parse(args.target_attack_tpr_at_fpr)
        except DPConfigError as err:
            raise DPConfigError(f"DPTrainingArguments: {err}") from None


def check_adaptive_clipping(args) -> None:
    """adaptive_clipping: parsed (written back in its canonical form), with flat clipping only."""
    if args.adaptive_clipping is None:
        return
    spec = AdaptiveClipping.parse(args.adaptive_clipping)
    if args.clipping != "flat":
        raise DPConfigError(f"DPTrainingArguments: adaptive_clipping follows a quantile of each example's whole "
                            f"gradient norm; clipping={args.clipping!r} does not clip to it: use clipping='flat'.")
    args.adaptive_clipping = str(spec)


def check_privacy_unit(args) -> None:
    """Refuse privacy_unit / max_rows_per_unit values and combinations that units do not support (also for callers
    that set `args.privacy_unit` after parsing, as the causal-LM recipe does)."""
    unit = args.privacy_unit
    if not isinstance(unit, str) or not unit:
        raise DPConfigError(f"DPTrainingArguments: privacy_unit={unit!r} must be 'row' or the name of a training-set "
                         "column (e.g. 'document_id').")
    if unit == "row":
        if args.max_rows_per_unit is not None:
            raise DPConfigError("DPTrainingArguments: max_rows_per_unit is set but privacy_unit='row' (one row per "
                             "unit). Set privacy_unit to the unit column or drop max_rows_per_unit.")
        return
    if args.max_rows_per_unit is not None and args.max_rows_per_unit < 1:
        raise DPConfigError(f"DPTrainingArguments: max_rows_per_unit={args.max_rows_per_unit} must be >= 1 (or None).")
    if not args.poisson_sampling:
        raise DPConfigError(f"DPTrainingArguments: privacy_unit={unit!r} needs poisson_sampling=True: units are drawn "
                         "by Poisson sampling (fixed-size shuffled batches of units are not implemented).")
    if args.cache_features:
        raise DPConfigError(f"DPTrainingArguments: cache_features=True with privacy_unit={unit!r}: cached linear-probe "
                         "features are per row and lose the unit column. Drop cache_features (the backbone then runs "
                         "each step).")


def validate_lp_fields(args) -> None:
    if args.lp_steps < 0:
        raise DPConfigError(f"DPTrainingArguments: lp_steps={args.lp_steps} must be >= 0 (0 = no linear-probing "
                            "phase).")
    if not args.lp_steps:
        extra = [n for n in ("lp_epsilon_fraction", "lp_per_device_train_batch_size", "lp_learning_rate")
                 if getattr(args, n) is not None]
        if extra:
            raise DPConfigError(f"DPTrainingArguments: {', '.join(extra)} set but lp_steps=0: there is no "
                                "linear-probing phase. Set lp_steps (e.g. 0.2 for the first 20 % of the steps) or drop "
                                "them.")
        return
    if args.trainable_blocks == 0:
        raise DPConfigError("DPTrainingArguments: lp_steps with trainable_blocks=0 would linear-probe twice. Set "
                         "trainable_blocks to the fine-tuning scope (None = all) or drop lp_steps.")
    if args.trainable_groups is not None:
        from ...scope.groups import is_linear_probe  # (torch: only when a layer selection is given)

        if is_linear_probe(args.trainable_groups):
            raise DPConfigError(f"DPTrainingArguments: lp_steps with trainable_groups={args.trainable_groups!r} (the "
                                "head alone: a linear probe) would linear-probe twice. Set trainable_groups to the "
                                "fine-tuning scope or drop lp_steps.")
    if args.lp_steps >= 1 and args.lp_steps != int(args.lp_steps):
        raise DPConfigError(f"DPTrainingArguments: lp_steps={args.lp_steps}: a number of steps must be whole "
                         "(or < 1 for a fraction of the planned steps).")
    frac = args.lp_epsilon_fraction
    if frac is not None and not 0 < frac < 1:
        raise DPConfigError(f"DPTrainingArguments: lp_epsilon_fraction={frac} must be in (0, 1).")
    if frac is not None and args.target_epsilon is None:
        raise DPConfigError("DPTrainingArguments: lp_epsilon_fraction splits target_epsilon; set target_epsilon "
                         "(or drop lp_epsilon_fraction to use noise_multiplier in both phases).")
    if args.clipping == "per_layer":
        raise DPConfigError("DPTrainingArguments: clipping='per_layer' splits C over a fixed set of tensors, which "
                         "changes between the linear-probe and fine-tune phases. Use clipping='flat' or 'automatic'.")
    if args.lp_per_device_train_batch_size is not None and not args.poisson_sampling:
        raise DPConfigError("DPTrainingArguments: lp_per_device_train_batch_size needs poisson_sampling=True "
                         "(fixed-size shuffled batches cannot change size mid-run).")


def validate_cache_fields(args) -> None:
    for name in ("cache_features_max_memory_gb", "cache_features_max_disk_gb"):
        if not getattr(args, name) >= 0:
            raise DPConfigError(f"DPTrainingArguments: {name}={getattr(args, name)} must be >= 0 (GiB).")
    if args.cache_features and args.trainable_blocks is None and args.trainable_groups is None:
        raise DPConfigError("DPTrainingArguments: cache_features=True with trainable_blocks=None (and no "
                            "trainable_groups): full fine-tuning has no frozen part to cache. Set trainable_blocks=k "
                            "(0 = linear probe) or leave cache_features=None.")


def check_report_to(args) -> None:
    """report_to="tensorboard" needs the optional tensorboard package (the `tensorboard` extra)."""
    import importlib.util

    if "tensorboard" in (args.report_to or []) and not any(
            importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
        raise DPConfigError("DPTrainingArguments: report_to='tensorboard' needs tensorboard, which is optional: "
                            "pip install 'hf-dp-repr[tensorboard]' (or drop it from report_to).")


# ---- several processes: one DP run, never several --------------------------------------------------------------
def launched_processes() -> int:
    """How many processes this run has according to the launcher's environment or an initialised
    torch.distributed (1 for a process started alone)."""
    counts = [int(os.environ[v]) for v in WORLD_SIZE_VARIABLES if os.environ.get(v, "").strip().isdigit()]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        counts.append(dist.get_world_size())
    return max(counts, default=1)


def join_cpu_processes() -> None:
    """Several launched processes on a machine without an accelerator (GPU, XPU, ...): tell accelerate to set up
    torch.distributed on CPU (gloo), as `use_cpu=True` does. Without it accelerate leaves each process alone (world
    size 1) and they train as independent DP runs. Run before the Trainer's arguments set up the devices."""
    if launched_processes() <= 1 or "ACCELERATE_USE_CPU" in os.environ:
        return
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; before it, only CUDA is checked
    if not (accelerator.is_available() if accelerator is not None else torch.cuda.is_available()):
        os.environ["ACCELERATE_USE_CPU"] = "true"
        logger.info("%d processes launched on a machine without an accelerator: ACCELERATE_USE_CPU=true, so "
                    "accelerate joins them into one run over torch.distributed on CPU (gloo)", launched_processes())


def check_one_run(world_size: int) -> None:
    """Refuse processes that were launched together but do not form one run (each would be a separate DP run on the
    same data: its own secret noise and batches, its own save and push, and a ledger stating the ε of one run)."""
    launched = launched_processes()
    if launched > 1 and world_size != launched:
        variables = ", ".join(f"{v}={os.environ[v]}" for v in WORLD_SIZE_VARIABLES if v in os.environ)
        raise ProcessGroupError(
            f"DPTrainer: {launched} processes were launched together ({variables or 'torch.distributed'}), but the "
            f"Trainer sees a world of {world_size}: accelerate did not join them into one run (torch.distributed "
            "is not set up for them). Each would train its own DP run on the same data, with its own secret noise, "
            "and save and push it, while the ledger states the ε of one run. Fix: on CPU set ACCELERATE_USE_CPU=true "
            "(or use_cpu=True) before the arguments are created, or use_configured_state=False in accelerator_config "
            "if an Accelerator was set up before; or start one process.")


def check_fresh_model(trainer, resuming: bool) -> None:
    """Refuse a train() on a model that an earlier DP run of this trainer already trained (a finished or failed
    run, or a ledger set from one), unless it resumes from a checkpoint or `model_init` makes a fresh model: the new
    run's ledger would start at ε = 0 while the model it releases carries both runs."""
    ledger = trainer.ledger
    if resuming or trainer.model_init is not None or ledger is None or ledger.steps_done == 0:
        return
    raise UnsupportedError(
        f"DPTrainer: this trainer's model was already trained by {ledger.steps_done} DP steps (ε = "
        f"{trainer.epsilon():.4g}); a second train() would start a new privacy ledger, and the model it releases "
        "would carry both runs while the ledger states the ε of the second only. Fix: resume with "
        "train(resume_from_checkpoint=...), pass model_init= to DPTrainer so that every train() starts from a "
        "fresh model, or make a new DPTrainer with a fresh model.")
