"""`DPTrainingArguments`: `transformers.TrainingArguments` plus the knobs of DP-SGD.

Example:
    >>> from hf_dp_repr import DPTrainingArguments
    >>> args = DPTrainingArguments(output_dir="out", target_epsilon=8.0, target_delta=1e-5,
    ...                            per_sample_max_grad_norm=1.0, report_to="none")
    >>> args.accountant, args.poisson_sampling, args.clipping
    ('prv', True, 'flat')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

ACCOUNTANTS = ("prv", "rdp", "gdp")
CLIPPING_MODES = ("flat", "per_layer", "automatic")


@dataclass
class DPTrainingArguments(TrainingArguments):
    """Arguments of a DP-SGD run. Give exactly one of `target_epsilon` (σ is then calibrated so the whole
    planned run spends exactly that ε) or `noise_multiplier` (ε is then whatever the run spends;
    `noise_multiplier=0` is an explicitly non-private run, ε = ∞)."""

    target_epsilon: float | None = field(
        default=None,
        metadata={"help": "Privacy budget ε for the whole planned run; σ is calibrated to spend it exactly. "
                  "Exclusive with --noise_multiplier."},
    )
    target_delta: float = field(
        default=1e-5,
        metadata={"help": "Privacy parameter δ, in (0, 1); keep it well below 1/n for n training examples."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "σ: Gaussian noise std divided by the clipping norm. Exclusive with --target_epsilon. "
                  "0 means an explicitly non-private run (clipping only, ε = ∞)."},
    )
    per_sample_max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "C: each example's gradient is clipped to L2 norm C before summing and noising."},
    )
    accountant: str = field(
        default="prv",
        metadata={"help": "Privacy accountant (Opacus): 'prv' (tightest), 'rdp' or 'gdp'.", "choices": ACCOUNTANTS},
    )
    poisson_sampling: bool = field(
        default=True,
        metadata={"help": "Draw each logical batch by Poisson sampling, as the accountants assume. False uses "
                  "shuffled fixed-size batches: the reported ε is then NOT a proven guarantee (warned)."},
    )
    clipping: str = field(
        default="flat",
        metadata={"help": "'flat' (one norm over all parameters), 'per_layer' (each parameter tensor clipped to "
                  "C/sqrt(#tensors), total sensitivity C) or 'automatic' (Bu et al.: g·C/(||g||+0.01)).",
                  "choices": CLIPPING_MODES},
    )
    secure_mode: bool = field(
        default=False,
        metadata={"help": "Sample batches from OS entropy and draw noise with Opacus' secure_mode (resists "
                  "floating-point attacks). Slower; single process only."},
    )
    # Trainer's own clipping would clip the *non-private* summed gradient and log its norm: a leak.
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Must stay 0 under DP: per-example clipping is --per_sample_max_grad_norm."},
    )

    def __post_init__(self):
        _validate_dp_fields(self)
        super().__post_init__()


def _validate_dp_fields(args: DPTrainingArguments) -> None:
    """Check the DP fields; each error names the argument and what to do instead."""
    eps, sigma = args.target_epsilon, args.noise_multiplier
    if eps is not None and sigma is not None:
        raise ValueError(
            "DPTrainingArguments: both target_epsilon and noise_multiplier are set. Give target_epsilon to have "
            "σ calibrated, or noise_multiplier to fix σ, not both."
        )
    if eps is None and sigma is None:
        raise ValueError(
            "DPTrainingArguments: neither target_epsilon nor noise_multiplier is set. Give target_epsilon "
            "(e.g. 8.0) for a private run; for an explicitly non-private reference set noise_multiplier=0."
        )
    if eps is not None and not eps > 0:
        raise ValueError(f"DPTrainingArguments: target_epsilon must be > 0, got {eps}.")
    if sigma is not None and not sigma >= 0:
        raise ValueError(f"DPTrainingArguments: noise_multiplier must be >= 0, got {sigma}.")
    if not 0 < args.target_delta < 1:
        raise ValueError(
            f"DPTrainingArguments: target_delta must be in (0, 1), got {args.target_delta}; a common choice is "
            "1/(10·n) for n training examples."
        )
    if not args.per_sample_max_grad_norm > 0:
        raise ValueError(
            f"DPTrainingArguments: per_sample_max_grad_norm must be > 0, got {args.per_sample_max_grad_norm}."
        )
    if args.accountant not in ACCOUNTANTS:
        raise ValueError(f"DPTrainingArguments: unknown accountant {args.accountant!r}; use one of {ACCOUNTANTS}.")
    if args.clipping not in CLIPPING_MODES:
        raise ValueError(f"DPTrainingArguments: unknown clipping {args.clipping!r}; use one of {CLIPPING_MODES}.")
    if args.max_grad_norm:
        raise ValueError(
            f"DPTrainingArguments: max_grad_norm={args.max_grad_norm} would clip the summed, non-private gradient "
            "and log its norm. Leave it at 0 and set per_sample_max_grad_norm for per-example clipping."
        )
    if args.auto_find_batch_size:
        raise ValueError(
            "DPTrainingArguments: auto_find_batch_size changes the sampling rate mid-run, which breaks the privacy "
            "accounting. Set per_device_train_batch_size and gradient_accumulation_steps yourself."
        )
