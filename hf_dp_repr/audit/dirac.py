"""White-box gradient ("Dirac") canaries: the one-run audit (Steinke, Nasr & Jagielski 2023, §6) on the update.

Input-space canaries (`canaries`) test the whole pipeline, but an example's gradient is rarely much larger than
the clipping norm C, so a run that forgets to clip looks like one that clips: the one-run audit missed clipping
switched off (24 of 40 guesses right, ε ≥ 0). A Dirac canary is a gradient, not an example: canary i's
per-example gradient is B·e_i, one coordinate of a parameter vector that nothing else touches, with B = 1000·C.
Clipped, it adds exactly C·e_i to the step's sum; unclipped, B·e_i; the noise adds N(0, σ²C²) to that coordinate.
The auditor reads, in white box, each step's released (noised) gradient at coordinate i (as the paper does with
the weights) and sums it over the run: in units of C, the number of steps that sampled canary i plus noise.

How it goes through the real DP-SGD (nothing re-implemented): `DiracCanaryTrainer` is a `DPTrainer` whose model
carries one extra `nn.Linear(m, 1)` (zero-initialised, `DIRAC_MODULE`); included canary i is a training row with
`dirac_canary = i` (its model inputs a copy of row 0, whose gradient is masked to exactly zero) and loss
B·w_i. DPTrainer samples it like any row (Poisson), its engine (ghost norms or Opacus hooks) clips it with the
run's `clipping`, the DP optimizer adds the noise, the ledger accounts for n = training rows + included canaries.
Rows of the data have `dirac_canary = -1` and no gradient on w. Each canary is included with probability 1/2, a
secret draw (`canaries.draw_inclusion`); the top-k scores are guessed "in", the bottom-k "out".

Example (the scoring half: summed released gradients at the canaries' coordinates, in units of C):
    >>> import numpy as np
    >>> from hf_dp_repr.audit.canaries import one_run_audit
    >>> scores = np.array([3.0, 0.0, 2.0, 0.0]); included = np.array([True, False, True, False])
    >>> out = one_run_audit(-scores, included, k=1, delta=0.0)   # a low "loss" means "in"
    >>> out["guesses"], out["correct"]
    (2, 2)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from datasets import Dataset, concatenate_datasets
from torch import nn
from transformers import TrainerCallback

from ..errors import ArgumentError, AuditDataError, DPConfigError
from ..training.trainer import DPTrainer
from .canaries import check_add_remove, draw_inclusion, one_run_audit

CANARY_COLUMN = "dirac_canary"  # canary index of a row, -1 for the data's own rows
DIRAC_MODULE = "dirac_canaries"  # the extra module on the audited model
MAGNITUDE_OVER_C = 1000.0  # B / C: clipped to exactly C; unclipped, 1000 times more


class DiracCanaries(nn.Module):
    """Row with canary index i ≥ 0 → B·w_i, whose gradient is B·e_i; rows with -1 → 0 (no gradient on w)."""

    def __init__(self, m: int, magnitude: float):
        super().__init__()
        self.m, self.magnitude = m, float(magnitude)
        self.weights = nn.Linear(m, 1, bias=False)
        nn.init.zeros_(self.weights.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        one_hot = F.one_hot(ids.clamp(min=0), self.m).to(self.weights.weight.dtype)
        return self.weights(one_hot * (ids >= 0).unsqueeze(1) * self.magnitude).squeeze(-1)


class _ReleasedGradient(TrainerCallback):
    """Sums each step's released (clipped + noised) gradient at the canaries' coordinates, in units of C/L."""

    def __init__(self, trainer: "DiracCanaryTrainer"):
        self.trainer = trainer
        self.total = np.zeros(trainer.dirac_canaries.m)

    def on_optimizer_step(self, args, state, control, **kwargs):
        opt, grad = self.trainer.engine.optimizer, self.trainer.dirac_canaries.weights.weight.grad
        self.total += grad.detach().double().flatten().cpu().numpy() * opt.expected_batch_size / opt.max_grad_norm


class DiracCanaryTrainer(DPTrainer):
    """A `DPTrainer` whose rows with `dirac_canary = i ≥ 0` are gradient canaries (module docstring). After
    `train()`, `canary_scores()` is each canary's summed released gradient in units of C."""

    def __init__(self, model, args, train_dataset, m: int, magnitude: float | None = None, **kwargs):
        model.add_module(DIRAC_MODULE, DiracCanaries(m, 0.0))  # the magnitude once the plan is made, below
        self.dirac_canaries = model.get_submodule(DIRAC_MODULE)
        self._canary_ids: torch.Tensor | None = None
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        if magnitude is None:  # C as the run's privacy plan states it (what is clipped to and accounted)
            magnitude = MAGNITUDE_OVER_C * self.privacy_plan().per_sample_max_grad_norm
        self.dirac_canaries.magnitude = float(magnitude)
        self._released = _ReleasedGradient(self)
        self.add_callback(self._released)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()  # the model's forward does not take the canary column: keep it
        if CANARY_COLUMN not in self._signature_columns:
            self._signature_columns.append(CANARY_COLUMN)

    def _prepare_inputs(self, inputs):
        # Every micro-batch goes through here (training steps and DPTrainer's start-of-training probe): the canary
        # column is taken off before the model sees the batch.
        ids = inputs.pop(CANARY_COLUMN, None)
        self._canary_ids = None if ids is None else ids.to(self.args.device)
        return super()._prepare_inputs(inputs)

    def per_example_loss(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        losses = super().per_example_loss(outputs, labels)
        if self._canary_ids is None:
            return losses
        # A canary row's loss is B·w_i alone: `where` gives its model loss exactly zero gradient.
        return torch.where(self._canary_ids >= 0, self.dirac_canaries(self._canary_ids), losses)

    def canary_scores(self) -> np.ndarray:
        return self._released.total.copy()


def with_dirac_canaries(train: Dataset, included: np.ndarray) -> Dataset:
    """`train` with `dirac_canary = -1`, plus one row per included canary i (`dirac_canary = i`, the model inputs
    and label of row 0: a placeholder whose gradient the loss masks)."""
    if CANARY_COLUMN in train.column_names:
        raise AuditDataError(f"with_dirac_canaries: the training set already has a {CANARY_COLUMN!r} column")
    base = train.with_format(None)
    chosen = np.flatnonzero(included).tolist()
    rows = base.add_column(CANARY_COLUMN, [-1] * len(base))
    canaries = base.select([0] * len(chosen)).add_column(CANARY_COLUMN, chosen)
    return concatenate_datasets([rows, canaries]).with_format("torch")


def train_with_dirac_canaries(model, args, train: Dataset, m: int, *, k: int, beta: float = 0.05,
                              magnitude: float | None = None, inclusion_seed: int | None = None) -> dict:
    """Draw the inclusions of m Dirac canaries, train `model` once with `DiracCanaryTrainer` on `train` + the
    included canaries, guess from the summed released gradients and bound ε. Returns what
    `canaries.train_with_canaries` returns (`kind="dirac"`, `trainer_obj`) and `scores` (units of C).

    `args` must be `DPTrainingArguments` with neighboring='add_remove' and privacy_unit='row'. `model` gains the
    module `dirac_canaries`: audit a copy, never save or push it.

    Example (σ = 0: nothing hides the canaries, so every guess is right; a second or two on a CPU):
        >>> from hf_dp_repr import DPTrainingArguments
        >>> from hf_dp_repr.data import load_digits_dataset
        >>> from hf_dp_repr.tiny import tiny_vit
        >>> args = DPTrainingArguments(output_dir="/tmp/dirac-doc", noise_multiplier=0.0, target_delta=1e-3,
        ...     neighboring="add_remove",  # a canary is a row added or left out
        ...     per_device_train_batch_size=16, max_steps=10, report_to="none", save_strategy="no",
        ...     logging_strategy="no", disable_tqdm=True, noise_seed=0)
        >>> train = load_digits_dataset()["train"].select(range(16))
        >>> out = train_with_dirac_canaries(tiny_vit(hidden_size=16, num_hidden_layers=1), args, train, m=32, k=4,
        ...                                 inclusion_seed=0)
        {'train_runtime': ...}
        >>> out["correct"], out["guesses"], out["claimed_epsilon"]
        (8, 8, None)
    """
    check_add_remove(args, "train_with_dirac_canaries")
    if args.privacy_unit != "row":
        raise DPConfigError(f"train_with_dirac_canaries: privacy_unit={args.privacy_unit!r}; each canary is one row, "
                            "so it audits a row-level guarantee. Use privacy_unit='row'.")
    if not 0 < 2 * k <= m:
        raise ArgumentError(f"train_with_dirac_canaries: need 0 < 2k <= m canaries, got k={k}, m={m}")
    included = draw_inclusion(m, inclusion_seed)
    data = with_dirac_canaries(train, included)
    trainer = DiracCanaryTrainer(model, args, data, m, magnitude)
    trainer.train()
    scores = trainer.canary_scores()
    # high score = "in" (a low "loss"); δ is the run's plan's, as its claimed ε
    result = one_run_audit(-scores, included, k, trainer.ledger.plan.target_delta, beta)
    claimed = trainer.ledger.epsilon()
    result.update(kind="dirac", claimed_epsilon=claimed if np.isfinite(claimed) else None,
                  training_examples=len(data), trainer="DiracCanaryTrainer (DPTrainer)",
                  noise_multiplier=trainer.ledger.plan.phases[-1].noise_multiplier, scores=scores,
                  trainer_obj=trainer)
    return result
