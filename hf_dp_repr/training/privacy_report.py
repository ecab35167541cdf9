"""What `DPTrainer` reports of its privacy (its ledger, ε in every log and the clipping that ran are read from its
engine by `DPTrainer` itself): the DP-SGD plan, logged once at the start of training
(`announce_plan`, on the main process); the library loggers' level following the Trainer's `log_level`;
what every log may hold, whoever added to it (`DPPublishedLogs`, the last class before `Trainer`).

The plan and the clipping engine are routine INFO lines of the `hf_dp_repr` loggers, shown by the recipes (their
logging setup) and, as the Trainer's own INFO lines, when `log_level` asks for them (`log_level="info"`). Lines that
ask for action (a seeded noise, no noise, no Poisson sampling) are warnings."""

from __future__ import annotations

import logging as std_logging

from transformers import Trainer
from transformers.utils import logging

from ..entry_point import warn_if_openmp_spins
from ..hub.public_names import PRIVATE_PREFIX, is_sample_counter
from ..privacy.clipping_modes import clipping_mode
from ..privacy.ledger import PrivacyLedger
from ..privacy.units import ROW, describe_unit
from ..scope.blocks import block_stack_name, describe_trainable
from . import TRAINER_LOGGER

logger = logging.get_logger(TRAINER_LOGGER)


class DPPublishedLogs(Trainer):
    """The last class before `Trainer` in a DP trainer's method order (after a TRL trainer's own `log`, which adds its
    metrics): every log, whoever computed what it holds, goes through here before `log_history`, the callbacks and
    trackers, and what `evaluate` returns. Counters of the training batches' rows or tokens (`is_sample_counter`:
    TRL's `eval_num_tokens`, its running count of TRAINING tokens, ...) are dropped; during the evaluation of a set
    drawn from the training data (`eval_overlap`: `_private_eval_prefixes`), every metric named as an evaluation's
    (the Trainer's and the subclass's, e.g. TRL's `eval_entropy`, `eval_rewards/*`) is named `train_*`, kept out of
    metrics files, the card and pushes as the Trainer's own keys are."""

    _private_eval_prefixes: tuple[str, ...] = ()  # set by DPTrainer.evaluate while it runs

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        for key in [k for k in logs if is_sample_counter(k)]:
            del logs[key]
        renamed = [k for k in logs if k.startswith(self._private_eval_prefixes)]
        for key in renamed:
            logs[PRIVATE_PREFIX + key] = logs.pop(key)
        super().log(logs, *args, **kwargs)


def announce_plan(ledger: PrivacyLedger, *, noise_seed, max_rows_per_unit, model, block_stack, describe_scope,
                  trained_params, start_checks: str | None = None, notes=()) -> None:
    """Log the run's plan (`ledger.plan`: the checkpoint's when resuming): σ, q, steps, ε at its end, per phase i
    what trains (`describe_scope(i)`, `trained_params(i)`), what the start-of-training checks cost (`start_checks`:
    `training.start_checks`), then `notes` (a recipe's: how its data was read, the defaults it chose); warnings for a
    seeded noise, no noise, no Poisson."""
    led = ledger.plan
    warn_if_openmp_spins()  # torch loaded before hf_dp_repr, with spinning threads, on a busy machine
    if led.randomness == "seeded":
        logger.warning(f"DPTrainer: noise_seed={noise_seed}. The noise and the batches are reproducible "
                       "from this seed: the run is NOT private against anyone who knows it. Use it for tests and "
                       "experiments only.")
    if ledger.noise_multiplier == 0:
        logger.warning("DPTrainer: noise_multiplier=0. This run is NOT differentially private (ε = ∞); "
                       + ("no clipping (the plain gradient)" if not clipping_mode(led.clipping).private else
                          "per-example clipping only") + ", as a non-private reference.")
    if not led.poisson_sampling:
        logger.warning("DPTrainer: poisson_sampling=False. Batches are shuffled and fixed-size; the ε reported "
                       "is computed as if they were Poisson-sampled and is NOT a proven guarantee.")
    target = f"target ε={led.target_epsilon}" if led.target_epsilon is not None else "σ given"
    if led.target_attack_tpr_at_fpr is not None:
        target = f"target_attack_tpr_at_fpr={led.target_attack_tpr_at_fpr}"
    lines = [f"DP-SGD plan ({target}, δ={led.target_delta:g}, {led.neighboring} neighbours, accountant="
             f"{led.accountant}, noise and batches from {led.randomness}, clipping={led.clipping} "
             f"C={led.per_sample_max_grad_norm}, unit of privacy: {describe_unit(led.privacy_unit)}, "
             f"{led.dataset_size} {'examples' if led.privacy_unit == ROW else 'units'}"
             + ("" if max_rows_per_unit is None else f" (at most {max_rows_per_unit} rows each per step)") +
             f"): ε at the end of the plan {led.planned_epsilon():.4f}"]
    if led.adaptive_clipping is not None:
        spec = led.adaptive_clipping
        lines.append(f"adaptive clipping: C from {ledger.clip_norm:g} towards the {spec.quantile:g} quantile of the "
                     f"norms (learning rate {spec.learning_rate:g}); the count's noise σ_b={spec.count_noise:.4g} "
                     "takes its share of each phase's σ, the gradient's is σ_eff="
                     + ", ".join(f"{led.gradient_noise_multiplier(i):.4f}" for i in range(len(led.phases))))
    stack = block_stack_name(model, block_stack)
    for i, phase in enumerate(led.phases):
        lines.append(f"phase '{phase.name}': σ={phase.noise_multiplier:.4f}, sample rate q={phase.sample_rate:.5f} "
                     f"(expected batch {phase.expected_batch_size}), {phase.steps} steps; trains "
                     f"{describe_scope(i)}")
        lines.append(describe_trainable(model, trained_params(i), phase.noise_multiplier,
                                        led.per_sample_max_grad_norm, phase.expected_batch_size, stack))
    if start_checks is not None:
        lines.append(start_checks)
    logger.info("\n".join([*lines, *notes]))
    for i, phase in enumerate(led.phases):
        warn_if_noise_drowns_updates(phase, sum(p.numel() for p in trained_params(i)))


# The expected signal-to-noise of an update below which training is warned it will likely not learn: the largest
# norm the averaged clipped gradient can have (C) over the norm of its noise (σ·C·√P/B), i.e. B / (σ·√P).
# Calibrated in benchmarks/RESULTS.md ("DP-aware defaults"): DP linear probes learned (well above the majority class)
# down to 0.018 with a suited learning rate, none at 0.01 or below; the run (B = 8, all of MiniLM): 0.0026.
LOW_UPDATE_SNR = 0.01


def update_snr(expected_batch: int, noise_multiplier: float, trained_parameters: int) -> float:
    """C over the noise norm of the averaged update: B / (σ·√P) (∞ without noise). At most this share of a step is
    signal, when every example's clipped gradient points the same way.

        >>> update_snr(100, 2.0, 2500)  # noise norm 2·C·50/100 = C
        1.0
        >>> round(update_snr(8, 0.6345, 22_713_606), 4)  # the issue's case: B = 8, all of MiniLM, noise norm 378·C
        0.0026
    """
    if noise_multiplier == 0:
        return float("inf")
    return expected_batch / (noise_multiplier * max(trained_parameters, 1) ** 0.5)


def warn_if_noise_drowns_updates(phase, trained_parameters: int) -> None:
    """Warn before training when a phase's expected update SNR (`update_snr`) is below `LOW_UPDATE_SNR`, naming the
    fixes (the check a budget passes that `plan.check_signal_survives` lets through)."""
    snr = update_snr(phase.expected_batch_size, phase.noise_multiplier, trained_parameters)
    if snr >= LOW_UPDATE_SNR:
        return
    logger.warning(
        f"DPTrainer: phase '{phase.name}': the noise of an averaged update has {1 / snr:.3g}× the norm the clipped "
        f"signal can have (expected batch B = {phase.expected_batch_size}, σ = {phase.noise_multiplier:.3g}, "
        f"{trained_parameters:,} trained parameters; signal-to-noise B/(σ·√P) = {snr:.2g} < {LOW_UPDATE_SNR:g}): "
        "training will likely not learn. Fixes: a larger expected batch (per_device_train_batch_size × "
        "gradient_accumulation_steps, hundreds or more), fewer trained parameters (trainable_blocks=0, a linear "
        "probe; or LoRA), or a larger target_epsilon. The recipes choose such settings when you leave them unset.")


def announce_spent(ledger: PrivacyLedger | None) -> None:
    """Log, at the end of training, ε spent and what it means for a membership attacker (`PrivacyLedger.summary`);
    computed only when INFO lines are shown (a privacy loss distribution: a fraction of a second)."""
    if ledger is not None and logger.isEnabledFor(std_logging.INFO):
        logger.info(f"DPTrainer: {ledger.summary()}")


def follow_log_level(args) -> None:
    """As the Trainer sets transformers' verbosity from `log_level` (main process) / `log_level_replica`, set the
    `hf_dp_repr` loggers' level; with the default "passive" they keep what the program configured."""
    level = args.log_level if args.should_log else args.log_level_replica
    if level == "passive":
        return
    library = std_logging.getLogger("hf_dp_repr")
    library.setLevel(args.get_process_log_level())
    if not library.handlers and not std_logging.getLogger().handlers:  # no logging set up: print as transformers
        library.addHandler(std_logging.StreamHandler())
