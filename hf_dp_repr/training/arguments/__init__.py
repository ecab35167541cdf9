"""`DPTrainingArguments`: `transformers.TrainingArguments` plus the knobs of DP-SGD.

Example:
    >>> from hf_dp_repr import DPTrainingArguments
    >>> args = DPTrainingArguments(output_dir="out", target_epsilon=8.0, target_delta=1e-5,
    ...                            per_sample_max_grad_norm=1.0, report_to="none")
    >>> args.accountant, args.neighboring, args.poisson_sampling, args.clipping
    ('pld', 'replace_one', True, 'flat')
    >>> DPTrainingArguments(output_dir="out", target_epsilon=8.0, accountant="prv", report_to="none").neighboring
    'add_remove'
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

from transformers import TrainingArguments

from ...errors import DPConfigError, ScopeError
from ...privacy.accountants import ACCOUNTANTS, NEIGHBORING_RELATIONS, check_accountant, default_neighboring
from ...privacy.clippers import CLIPPERS
from ...privacy.clipping_modes import CLIPPING_MODES
from ...registry import Choices
from ...scope.groups import parse_groups
from ...scope.head_init import HEAD_INITS, check_head_init
from ..accuracy_checks import check_accuracy_fields
from ..continual.public_phase import SWITCHES
from ..sharding import check_processes, sharding_request
from .checks import (
    check_adaptive_clipping,
    check_one_run,
    check_privacy_target,
    check_privacy_unit,
    check_report_to,
    join_cpu_processes,
    validate_cache_fields,
    validate_lp_fields,
)
from .fields import check_refused_fields

CLIPPING_ENGINES = Choices("auto", registry=CLIPPERS)  # "ghost", "hooks" and any registered later: privacy.clippers

# Hub strategies that exist to push resumable checkpoints: trainer_state.json (the loss of every logged step, computed
# on private data), optimizer and RNG state, training_args.bin. A checkpoint without them would not resume.
RESUMABLE_HUB_STRATEGIES = ("checkpoint", "all_checkpoints")


@dataclass
class DPTrainingArguments(TrainingArguments):
    """Arguments of a DP-SGD run. Give exactly one of `target_epsilon` (σ is then calibrated so the whole
    planned run spends exactly that ε), `target_attack_tpr_at_fpr` (σ calibrated so that no membership test reaches
    more than that TPR at that FPR) or `noise_multiplier` (ε is then whatever the run spends;
    `noise_multiplier=0` is an explicitly non-private run, ε = ∞)."""

    target_epsilon: float | None = field(
        default=None,
        metadata={"help": "Privacy budget ε for the whole planned run; σ is calibrated to spend it exactly. "
                  "Exclusive with --noise_multiplier and --target_attack_tpr_at_fpr."},
    )
    target_attack_tpr_at_fpr: str | None = field(
        default=None,
        metadata={"help": "A target for the attacker instead of ε, written 'TPR@FPR' (fractions): '0.05@0.01' "
                  "calibrates σ so that no membership test on the released model reaches a true-positive rate above "
                  "0.05 at a false-positive rate of 0.01, from the whole planned run's privacy loss distribution, for "
                  "the run's neighbouring relation. The ledger, log and card state the target and the ε it gives. "
                  "Exclusive with --target_epsilon and --noise_multiplier."},
    )
    target_delta: float = field(
        default=1e-5,
        metadata={"help": "Privacy parameter δ, in (0, 1); below 1/n for n training examples (or units): a larger "
                  "δ is refused unless allow_large_delta."},
    )
    allow_large_delta: bool = field(
        default=False,
        metadata={"help": "Train with δ ≥ 1/n (n: training examples, or units): such a δ allows releasing a few "
                  "examples outright, so it is refused by default; the model card then states it in plain words. "
                  "Only to compare with a paper that used δ = 1/n."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "σ: Gaussian noise std divided by the clipping norm. Exclusive with the two targets. "
                  "0 means an explicitly non-private run (clipping only, ε = ∞)."},
    )
    per_sample_max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "C: each example's gradient is clipped to L2 norm C before summing and noising."},
    )
    accountant: str = field(
        default="pld",
        metadata={"help": "Privacy accountant: 'pld' (dp_accounting's privacy loss distributions, default; the only "
                  "one for neighboring='replace_one'), 'prv' or 'rdp' (Opacus; add/remove neighbours only), or one "
                  "added by `register_accountant`. 'gdp' is refused: it under-reports ε.",
                  "choices": ACCOUNTANTS},  # the live registry: later registrations are choices too
    )
    neighboring: str | None = field(
        default=None,
        metadata={"help": "What ε protects: 'replace_one' (datasets of the same size n differing in one example; the "
                  "relation that holds when n is published, as the ledger and the model card do) or 'add_remove' "
                  "(one example added or removed: n, and the sample rate, steps and epochs that reveal it, must stay "
                  "secret; Opacus' setting, smaller ε; the card then states the run's replace-one ε as its "
                  "guarantee). Default: what the accountant computes, 'replace_one' for 'pld', 'add_remove' for "
                  "'prv' and 'rdp'.", "choices": NEIGHBORING_RELATIONS},
    )
    noise_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of DP-SGD's noise and Poisson batches, for reproducible tests and experiments. NOT "
                  "private: anyone who knows it can remove the noise. Default None: a fresh secret from OS entropy "
                  "for every run, never stored (the Trainer's `seed` never reaches the noise or the sampling)."},
    )
    poisson_sampling: bool = field(
        default=True,
        metadata={"help": "Draw each logical batch by Poisson sampling, as the accountants assume. False uses "
                  "shuffled fixed-size batches: the reported ε is then NOT a proven guarantee (warned)."},
    )
    clipping: str = field(
        default="flat",
        metadata={"help": "'flat' (one norm over all parameters), 'per_layer' (each parameter tensor clipped to "
                  "C/sqrt(#tensors), total sensitivity C) or 'automatic' (Bu et al.: g·C/(||g||+0.01)). 'none' "
                  "(with noise_multiplier=0 only): the true non-private reference, the plain gradient through the "
                  "same trainer (ε = ∞). Any mode registered in `privacy.clipping_modes`.",
                  "choices": CLIPPING_MODES.keys()},
    )
    adaptive_clipping: str | None = field(
        default=None,
        metadata={"help": "Adaptive clipping (Andrew et al. 2021): C starts at per_sample_max_grad_norm and follows a "
                  "quantile of the per-example norms, from a noisy count that takes a share of σ (accounted): "
                  "'quantile=0.5,learning_rate=0.2,count_noise=S' (any subset, or 'on' for these defaults; "
                  "count_noise σ_b defaults to the expected batch / 20; or count_share=F: the count takes the share F "
                  "of σ⁻²). flat clipping only. See "
                  "privacy.adaptive_clipping."},
    )
    clipping_engine: str = field(
        default="auto",
        metadata={"help": "How per-example gradients are clipped (same clipping, same guarantee): 'ghost' (ghost norms "
                  "and book-keeping in one backward, no per-example gradient held for large tensors), 'hooks' (Opacus "
                  "per-sample gradient hooks) or 'auto' (default): 'ghost' when it supports the model, else 'hooks' "
                  "with the reason logged.", "choices": CLIPPING_ENGINES},
    )
    secure_mode: bool = field(
        default=False,
        metadata={"help": "Sample batches directly from OS entropy and draw noise with Opacus' secure_mode (resists "
                  "floating-point attacks). Slower; single process only. (Noise and batches always come from a "
                  "secret OS-entropy seed, secure_mode or not.)"},
    )
    trainable_blocks: int | None = field(
        default=None,
        metadata={"help": "Train only the last k transformer blocks, the modules after them (final norm, pooler) "
                  "and the task head: the short form of trainable_groups='last:k,final,head'; 0 = linear probe "
                  "(trainable_groups='head'); None (default) = every parameter. Embeddings train only with None."},
    )
    trainable_groups: str | None = field(
        default=None,
        metadata={"help": "Layer selection beyond the last k blocks (exclusive with trainable_blocks): a comma-"
                  "separated union of block selectors (an index, 'first:k', 'last:k', 'every_other', "
                  "'every_other:odd') and named groups ('head', 'final': the modules after the blocks, 'norms', "
                  "'biases', 'attention', 'mlp'), e.g. 'biases,head' (BitFit) or 'first:2,norms,head'. Only what is "
                  "named trains; 'head' alone is the linear probe. A list also works."},
    )
    block_stack: str | None = field(
        default=None,
        metadata={"help": "Dotted name of the model's list of transformer blocks (e.g. 'encoder.layer'), for models "
                  "where it is not found automatically (the largest ModuleList of identical modules)."},
    )
    lp_steps: float = field(
        default=0,
        metadata={"help": "Linear probe then fine-tune (DP-LP→FFT): optimizer steps of a first phase that trains "
                  "the head alone, before the trainable_blocks scope trains. < 1: a fraction of the planned steps; "
                  ">= 1: a number of steps; 0 (default): no linear-probing phase."},
    )
    lp_epsilon_fraction: float | None = field(
        default=None,
        metadata={"help": "Share of target_epsilon spent by the linear-probing phase (its σ is calibrated for it "
                  "alone; the fine-tuning σ so that the composition spends exactly target_epsilon). None: one σ "
                  "for both phases, calibrated on their composition."},
    )
    lp_per_device_train_batch_size: int | None = field(
        default=None,
        metadata={"help": "Per-device batch size of the linear-probing phase (default: per_device_train_batch_size)."},
    )
    lp_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Constant learning rate of the linear-probing phase (default: learning_rate)."},
    )
    head_init: str = field(
        default="default",
        metadata={"help": "How the task head starts: 'default' (the model's own initialisation) or 'zeros' (the head's "
                  "output layer, weight and bias, set to zero before training; known to help under DP). Uses no "
                  "data.", "choices": HEAD_INITS},
    )
    cache_features: bool | None = field(
        default=None,
        metadata={"help": "Compute what the frozen part of the model feeds the trained part once, and train (and "
                  "evaluate) on it: the head's inputs for a linear probe (trainable_blocks=0), the hidden states "
                  "entering the first trained block for trainable_blocks=k or a trainable_groups scope (also in the "
                  "linear-probing phase of lp_steps). The frozen part runs in eval mode, cached or not. None "
                  "(default): when it gives the same updates (no transform on the dataset, nothing below the scope "
                  "trains, fixed-length rows, within the size bounds), else the uncached path with the reason "
                  "logged; False: never (e.g. random augmentation); True: always, or an error."},
    )
    cache_features_max_memory_gb: float = field(
        default=4.0,
        metadata={"help": "Most memory (GiB) the cached features of this process may take (oldest dropped first)."},
    )
    cache_features_max_disk_gb: float = field(
        default=0.0,
        metadata={"help": "Features over the memory bound go to a numpy memmap in a fresh temporary folder (never "
                  "output_dir; deleted at exit) up to this size (GiB). 0 (default): never on disk (they are "
                  "features of private data); over the memory bound the run is uncached (logged)."},
    )
    privacy_unit: str = field(
        default="row",
        metadata={"help": "What one unit of privacy is: 'row' (one training example, the default) or the name of a "
                  "training-set column (e.g. 'document_id', 'user_id'): all rows sharing a value are one unit, "
                  "sampled together, their gradients summed and clipped to C as one contribution, and ε protects one "
                  "unit. per_device_train_batch_size then counts units. The column is consumed by DPTrainer."},
    )
    max_rows_per_unit: int | None = field(
        default=None,
        metadata={"help": "With a privacy_unit column: at most this many rows of a sampled unit enter a step (a "
                  "subset drawn with the run's secret randomness); bounds the rows per step when a unit is large. "
                  "None (default): all of its rows."},
    )
    ema_decay: float | None = field(
        default=None,
        metadata={"help": "Weight averaging: release the exponential moving average of the DP iterates (post-"
                  "processing, no privacy cost) to evaluate, save, checkpoints' model files and pushes; decay "
                  "min(ema_decay, (1+t)/(10+t)) after noisy step t (e.g. 0.999). None (default): the last iterate. "
                  "See training.averaging."},
    )
    augmentation_multiplicity: int = field(
        default=1,
        metadata={"help": "k views of each sampled example through the training set's own random transform "
                  "(set_transform / with_transform), fresh at every step; the mean of their gradients is clipped "
                  "once (De et al. 2022). Same sampling, σ and ε as k = 1; k times the compute. See "
                  "privacy.augmentation."},
    )
    probe_preconditioning: str = field(
        default="none",
        metadata={"help": "Linear probe only: 'standardize' (per-feature mean and std) or 'pca:K' (standardise, "
                  "then the top K principal directions) of the head's input, fitted on DPTrainer's "
                  "public_train_dataset alone (no ε), folded into the saved head; 'none' (default). See "
                  "scope.preconditioning."},
    )
    allow_noise_dominated: bool = field(
        default=False,
        metadata={"help": "Go on when the σ calibrated for target_epsilon is so large that the noise dwarfs the "
                  "clipped signal (σ ≥ "
                  "10 × the expected batch: the noise's std in every coordinate of the averaged update is at least "
                  "10× the largest norm the clipped gradient can have); refused by default, naming the fixes."},
    )
    # ---- public → private continual training (DPTrainer(public_train_dataset=...), training.continual) ----
    public_switch: str = field(
        default="fixed",
        metadata={"help": "When a run with a public_train_dataset switches from non-private public training to DP-SGD: "
                  "'fixed' (after public_max_steps), 'decelerator' (when seed 004's decelerator σ²C²tr(H)/B² falls to "
                  "decelerator_threshold × ḡᵀHḡ, the curvature along the clipped gradient) or 'plateau' (public eval "
                  "loss).",
                  "choices": SWITCHES},
    )
    public_max_steps: int = field(default=0, metadata={
        "help": "Non-private steps on the public training set: the switch step ('fixed') or the most before it."})
    public_check_steps: int = field(default=10, metadata={
        "help": "Every this many steps: tr(H) (Hutchinson, public batch), the decelerator and the switch test."})
    public_phase_learning_rate: float | None = field(default=None, metadata={
        "help": "Learning rate of the public phase (default: learning_rate), constant."})
    public_per_device_train_batch_size: int | None = field(default=None, metadata={
        "help": "Batch size of the public phase (default: per_device_train_batch_size)."})
    decelerator_threshold: float = field(default=1.0, metadata={
        "help": "public_switch='decelerator': switch when σ²C²tr(H)/B² ≤ this × ḡᵀHḡ (1: a DP step at its best step "
                "size keeps at least half of the non-private per-step loss decrease)."})
    public_plateau_patience: int = field(default=3, metadata={
        "help": "public_switch='plateau': switch after this many checks without a better public eval loss."})
    hessian_probes: int = field(default=8, metadata={"help": "Rademacher probes per Hutchinson tr(H) estimate."})
    hessian_max_examples: int = field(default=32, metadata={
        "help": "Public examples in the batch tr(H) and the first-order decrease are measured on."})
    # Trainer's own clipping would clip the *non-private* summed gradient and log its norm: a leak.
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Must stay 0 under DP: per-example clipping is --per_sample_max_grad_norm."},
    )

    # DP training computes its own per-example losses, so this only changes evaluation, where (transformers 5.x)
    # it multiplies a classifier's eval loss by the number of processes (transformers issue 35078).
    average_tokens_across_devices: bool = field(
        default=False,
        metadata={"help": "Off by default under DP: DP-SGD sums per-example losses over the logical batch itself, "
                  "and with several processes this Trainer option would multiply a classifier's eval loss by their "
                  "number."},
    )

    def __post_init__(self):
        validate_dp_fields(self)
        if self.output_dir is None:  # transformers says so at INFO only: say where the run and its ledger go
            warnings.warn(f"DPTrainingArguments: no output_dir given; checkpoints, the privacy ledger and the model "
                          f"card go to {os.path.abspath('trainer_output')} (transformers' default).", stacklevel=3)
        join_cpu_processes()  # before the Trainer's arguments set up accelerate: several processes are one run
        super().__post_init__()
        check_one_run(self.world_size)
        if sharding_request(self) is not None:  # DPTrainer shards the model itself (training.sharding)
            check_processes(self)
            self.fsdp_plugin_args = None  # accelerate never builds its FSDP plugin
        check_report_to(self)  # after the Trainer made report_to a list
        _validate_activation_checkpointing(self)  # after the Trainer resolves gradient_checkpointing* aliases


def validate_dp_fields(args: DPTrainingArguments) -> None:
    """Check the DP fields; each error names the argument and what to do instead."""
    check_privacy_target(args)  # one of target_epsilon, target_attack_tpr_at_fpr, noise_multiplier
    if not 0 < args.target_delta < 1:
        raise DPConfigError(
            f"DPTrainingArguments: target_delta must be in (0, 1), got {args.target_delta}; a common choice is "
            "1/(10·n) for n training examples."
        )
    if not args.per_sample_max_grad_norm > 0:
        raise DPConfigError(
            f"DPTrainingArguments: per_sample_max_grad_norm must be > 0, got {args.per_sample_max_grad_norm}."
        )
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "lp_per_device_train_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DPConfigError(f"DPTrainingArguments: {name}={value} must be >= 1: the logical batch (per-device "
                             "batch × gradient_accumulation_steps × processes) sets the sampling rate q = batch / n.")
    if args.neighboring is None:  # what the accountant computes: Opacus' accountants know add/remove only
        args.neighboring = default_neighboring(args.accountant)
    try:
        check_accountant(args.accountant, args.neighboring)
    except ValueError as err:
        raise DPConfigError(f"DPTrainingArguments: {err}") from None
    check_head_init(args.head_init)
    if args.clipping_engine not in CLIPPING_ENGINES:
        raise DPConfigError(f"DPTrainingArguments: unknown clipping_engine {args.clipping_engine!r}; use one of "
                            f"{tuple(CLIPPING_ENGINES)}.")
    if args.clipping not in CLIPPING_MODES:
        raise DPConfigError(f"DPTrainingArguments: unknown clipping {args.clipping!r}; use one of "
                            f"{tuple(CLIPPING_MODES)}.")
    check_adaptive_clipping(args)
    if not CLIPPING_MODES[args.clipping].private and args.noise_multiplier != 0:
        raise DPConfigError(f"DPTrainingArguments: clipping={args.clipping!r} bounds no example's influence, so no "
                            "noise makes it private; it is only for the non-private reference: set noise_multiplier=0 "
                            "(and no target_epsilon), or use clipping='flat'.")
    if args.trainable_blocks is not None and args.trainable_blocks < 0:
        raise DPConfigError(f"DPTrainingArguments: trainable_blocks={args.trainable_blocks} must be >= 0 "
                         "(0 = linear probe: head only; None = train every parameter).")
    if args.trainable_groups is not None:
        if args.trainable_blocks is not None:
            raise ScopeError("DPTrainingArguments: trainable_blocks and trainable_groups are both set; give one (e.g. "
                             "trainable_groups='last:2,norms,head' for the last 2 blocks, every norm and the head).")
        parse_groups(args.trainable_groups)  # unknown names fail here, before any work
    validate_lp_fields(args)
    check_privacy_unit(args)
    if args.public_switch not in SWITCHES:
        raise DPConfigError(f"DPTrainingArguments: public_switch={args.public_switch!r}; use one of {SWITCHES}.")
    for name in ("public_max_steps", "public_check_steps", "hessian_probes", "hessian_max_examples",
                 "public_plateau_patience"):
        if getattr(args, name) < (0 if name == "public_max_steps" else 1):
            raise DPConfigError(f"DPTrainingArguments: {name}={getattr(args, name)} is out of range.")
    validate_cache_fields(args)
    check_accuracy_fields(args)  # ema_decay, augmentation_multiplicity, probe_preconditioning
    if args.noise_seed is not None and args.secure_mode:
        raise DPConfigError("DPTrainingArguments: noise_seed makes the noise reproducible, secure_mode makes it "
                         "unguessable; drop one of them.")
    check_hub_strategy(args)
    check_refused_fields(args)  # the Trainer's own options that DP-SGD cannot honour (trainer_fields.FIELDS)
    sharding_request(args)  # fsdp / fsdp_config and accelerate's FSDP/DeepSpeed switches (training.sharding)


def _validate_activation_checkpointing(args: DPTrainingArguments) -> None:
    """Non-reentrant checkpointing (torch's and transformers' default) recomputes blocks where Opacus' hooks
    capture no activations ("no per-sample gradient"); the reentrant variant gives exact per-sample gradients."""
    kwargs = args.activation_checkpointing_kwargs or {}
    if args.activation_checkpointing and kwargs.get("use_reentrant") is not True:
        raise DPConfigError(
            "DPTrainingArguments: gradient_checkpointing needs gradient_checkpointing_kwargs={'use_reentrant': True} "
            "under DP-SGD (the non-reentrant default hides activations from the per-sample gradient hooks). "
            "Set it, or turn gradient_checkpointing off."
        )


def check_hub_strategy(args: TrainingArguments) -> None:
    """Refuse the hub strategies that push resumable checkpoints (also called by DPTrainer, after set_push_to_hub)."""
    strategy = getattr(args.hub_strategy, "value", args.hub_strategy)
    if args.push_to_hub and strategy in RESUMABLE_HUB_STRATEGIES:
        raise DPConfigError(
            f"DPTrainingArguments: hub_strategy={strategy!r} pushes resumable checkpoints: trainer_state.json (the "
            "loss of every logged step, computed on the private data), optimizer and RNG state and training_args.bin, "
            "none of which the DP guarantee covers. Use hub_strategy='every_save' (weights, ledger and DP card at each "
            "save) or 'end', keep checkpoints local for resuming, and push the finished run with trainer.push_to_hub() "
            "or `hf-dp-repr push OUTPUT_DIR --hub_model_id me/name`."
        )
