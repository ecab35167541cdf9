"""The DP-SGD plan `DPTrainer` logs once at the start of training (a mixin placed before `Trainer`).

The plan and the clipping engine are routine INFO lines of the `hf_dp_repr` loggers, shown by the recipes (their
logging setup) and, as the Trainer's own INFO lines, when `log_level` asks for them (`log_level="info"`). Lines that
ask for action (a seeded noise, no noise, no Poisson sampling) are warnings."""

from __future__ import annotations

import logging as std_logging

from transformers.utils import logging

from ..privacy.units import ROW, describe_unit
from ..scope.blocks import block_stack_name, describe_trainable
from . import TRAINER_LOGGER

logger = logging.get_logger(TRAINER_LOGGER)


class DPPlanReportMixin:
    """`_announce_plan`: σ, q, steps, ε at the end of the plan, and what trains in each phase."""

    def _announce_plan(self) -> None:
        if not self.is_world_process_zero():  # once, not once per process
            return
        led = self.ledger.plan  # the checkpoint's plan when resuming
        if led.randomness == "seeded":
            logger.warning(f"DPTrainer: noise_seed={self.args.noise_seed}. The noise and the batches are reproducible "
                           "from this seed: the run is NOT private against anyone who knows it. Use it for tests and "
                           "experiments only.")
        if self.ledger.noise_multiplier == 0:
            logger.warning("DPTrainer: noise_multiplier=0. This run is NOT differentially private (ε = ∞); "
                           + ("no clipping (the plain gradient)" if led.clipping == "none" else
                              "per-example clipping only") + ", as a non-private reference.")
        if not led.poisson_sampling:
            logger.warning("DPTrainer: poisson_sampling=False. Batches are shuffled and fixed-size; the ε reported "
                           "is computed as if they were Poisson-sampled and is NOT a proven guarantee.")
        target = f"target ε={led.target_epsilon}" if led.target_epsilon is not None else "σ given"
        lines = [f"DP-SGD plan ({target}, δ={led.target_delta:g}, {led.neighboring} neighbours, accountant="
                 f"{led.accountant}, noise and batches from {led.randomness}, clipping={led.clipping} "
                 f"C={led.per_sample_max_grad_norm}, unit of privacy: {describe_unit(led.privacy_unit)}, "
                 f"{led.dataset_size} {'examples' if led.privacy_unit == ROW else 'units'}"
                 + ("" if self.args.max_rows_per_unit is None
                    else f" (at most {self.args.max_rows_per_unit} rows each per step)") +
                 f"): ε at the end of the plan {led.planned_epsilon():.4f}"]
        stack = block_stack_name(self.model, self.args.block_stack)
        for i, phase in enumerate(led.phases):
            lines.append(f"phase '{phase.name}': σ={phase.noise_multiplier:.4f}, sample rate q={phase.sample_rate:.5f} "
                         f"(expected batch {phase.expected_batch_size}), {phase.steps} steps; trains "
                         f"{self.describe_scope(i)}")
            params = (self._scopes[min(i, len(self._scopes) - 1)].parameters if self._scopes
                      else [p for p in self.model.parameters() if p.requires_grad])
            lines.append(describe_trainable(self.model, params, phase.noise_multiplier, led.per_sample_max_grad_norm,
                                            phase.expected_batch_size, stack))
        logger.info("\n".join(lines))

    def _follow_log_level(self) -> None:
        """As the Trainer sets transformers' verbosity from `log_level` (main process) / `log_level_replica`, set the
        `hf_dp_repr` loggers' level; with the default "passive" they keep what the program configured."""
        level = self.args.log_level if self.args.should_log else self.args.log_level_replica
        if level == "passive":
            return
        library = std_logging.getLogger("hf_dp_repr")
        library.setLevel(self.args.get_process_log_level())
        if not library.handlers and not std_logging.getLogger().handlers:  # no logging set up: print as transformers
            library.addHandler(std_logging.StreamHandler())
