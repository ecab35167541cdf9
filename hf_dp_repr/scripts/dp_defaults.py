"""DP-aware defaults of the classification recipes: the training hyperparameters the user did not set, chosen by one
rule from public quantities only (the number n of private examples, ε, whether the model is pretrained), never from
the private data. Every option the user set (on the command line or in `--config`) replaces its own value only; the
rule fills in the others, knowing what was set (blocks given as the scope: the optimizer of blocks). The scope is
chosen by `--trainable_blocks` / `--trainable_groups` / `--lp_steps`; `--dp_defaults off` keeps the library's and
the Trainer's own defaults for everything (every parameter trains: full fine-tuning). The plan prints what was
chosen and why.

The rule (DESIGN.md "Choosing DP hyperparameters from public quantities"; measured in benchmarks/RESULTS.md,
"DP-aware defaults", with `benchmarks/dp_defaults.py`):

- What trains: a linear probe (`trainable_blocks=0`) on a pretrained model (or one pre-trained on public data): the
  frozen backbone's features are computed once and only the head trains, so steps are cheap and the noise is spread
  over few coordinates (Tobaben et al. 2023, Mehta et al. 2023: probes win at small n and ε). A model without
  pretrained weights is refused earlier (`PublicPretrainingArguments.resolved_public_fraction`).
- Expected batch: large, since the noise of an averaged update is σC/B and σ grows more slowly than B (Sander et al.
  2023): a quarter of the data, `PROBE_SAMPLE_RATE`, capped at `MAX_BATCH`; a scope with blocks in it (the user's
  `--trainable_blocks k`) accumulates micro-batches of `MICRO_BATCH`.
- Steps: `PROBE_EPOCHS` epochs for a probe (160 steps at q = 1/4); `FINE_TUNE_EPOCHS` when blocks train.
- Optimizer: plain SGD for a probe, with a learning rate that grows with ε (the best learning rate × steps grows about
  linearly with ε: Panda et al. 2024) and is divided by a scale s of the head's input on data-free inputs (the
  distance between a black and a white image's, the norm of an empty text's: a property of the public weights; a
  step moves the logits by about lr·C·s, and s is 22.6 for DINOv2-S, ~1.2 for MiniLM), capped; with public
  images given (`--public_dataset_name`), the probe's input is standardised on them (`probe_preconditioning`),
  s = √d for its d inputs (each has unit variance on the public images) and the rate is `STANDARDISED_LR_FACTOR`
  times the rule's (chosen on validation images); a zero-initialised
  head (known to help under DP); automatic clipping (each example's gradient scaled to norm about C, Bu et al.
  2023; it helped at ε ≤ 1 in the measurements). AdamW at `FINE_TUNE_LR` when blocks train (Li et al. 2022's
  large-batch DP fine-tuning).
- Language models (`train lm|sft|dpo`: `choose_language`, from n units, the model's size and whether it is
  pretrained): LoRA adapters for a pretrained model of at least `LORA_MIN_PARAMETERS` when peft is installed, else
  every parameter; the same expected batch in micro-batches of `LANGUAGE_MICRO_BATCH`; `FINE_TUNE_EPOCHS` epochs;
  AdamW at `LORA_LR` (adapters) or `FINE_TUNE_LR`. Not measured here (the rates are the literature's).

    >>> from hf_dp_repr.scripts.dp_defaults import choose
    >>> chosen = choose(n=1000, epsilon=8.0, given=set())
    >>> chosen.values["trainable_blocks"], chosen.values["per_device_train_batch_size"], chosen.values["optim"]
    (0, 250, 'sgd')
    >>> given = choose(n=1000, epsilon=8.0, given={"learning_rate"}).values  # a learning rate given: its own value
    >>> "learning_rate" in given, given["trainable_blocks"], given["optim"]
    (False, 0, 'sgd')
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The options the rule sets. Any of them given by the user is kept as given.
TRAINING_HYPERPARAMETERS = ("trainable_blocks", "per_device_train_batch_size", "gradient_accumulation_steps",
                            "num_train_epochs", "optim", "learning_rate", "head_init", "clipping",
                            "probe_preconditioning")
# Options that choose what trains: given any of them, the rule leaves the scope alone (and does not zero the head).
SCOPE_OPTIONS = ("trainable_blocks", "trainable_groups", "lp_steps")
STEP_OPTIONS = ("num_train_epochs", "max_steps")

PROBE_SAMPLE_RATE = 0.25  # expected batch = q·n ...
MIN_BATCH, MAX_BATCH = 16, 1024  # ... within these bounds (and at most n)
MICRO_BATCH = 32  # examples per forward/backward when blocks train (the rest is gradient accumulation)
PROBE_EPOCHS, FINE_TUNE_EPOCHS = 40, 10
# SGD learning rate of a probe: 0.9·ε / s, at most 8 / s, where s is the scale of the head's input on data-free
# inputs (`head_input_norm`): a step moves the logits by about lr·C·s, so lr·s is what carries over between backbones
PROBE_LR_PER_EPSILON, PROBE_MAX_LR = 0.9, 8.0
# ... times this when public images standardise the probe's input (s = √d then), chosen on validation images
# (benchmarks/RESULTS.md, "Public images for the probe"): ×1 / ×3 / ×10 gave 57.0 / 59.9 / 58.8 % at ε = 8
STANDARDISED_LR_FACTOR = 3.0
FINE_TUNE_LR = 5e-4  # AdamW, when blocks train (and every parameter of a language model)
LANGUAGE_MICRO_BATCH = 8  # sequences per forward/backward of a language model
LORA_MIN_PARAMETERS = 100_000_000  # a pretrained language model this large trains LoRA adapters (peft installed)
LORA_LR = 1e-3  # AdamW on LoRA adapters
ADAM_PROBE_LR = 0.05  # a probe with an Adam-type --optim the user gave


@dataclass
class Defaults:
    """What the rule chose (`values`: option → value) and why (`reasons`: one line per choice)."""

    values: dict = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    off: bool = False  # --dp_defaults off

    def set(self, name: str, value, why: str) -> None:
        self.values[name] = value
        self.reasons.append(f"--{name} {value}: {why}")

    def describe(self) -> str:
        if self.off:
            return ("DP-aware defaults: off (--dp_defaults off): the library's and the Trainer's own defaults for "
                    "every option you did not give; every parameter trains unless --trainable_blocks/--trainable_groups"
                    " say otherwise")
        if not self.values:
            return "DP-aware defaults: none applied (every training hyperparameter was given)"
        return ("DP-aware defaults (hf_dp_repr.scripts.dp_defaults; from n, ε and the model only; each option you give "
                "replaces its own value only; --dp_defaults off: none):\n  " + "\n  ".join(self.reasons))


def choose(n: int, epsilon: float | None, given: set[str], trainable_blocks: int | None = None,
           gradient_accumulation_steps: int = 1, world_size: int = 1, optim: str = "adamw_torch",
           feature_norm: float | None = None, public_width: int | None = None,
           probe_preconditioning: str = "none") -> Defaults:
    """The values of the `TRAINING_HYPERPARAMETERS` not in `given`, for `n` private examples (units) at `epsilon`
    (None: σ given or an attack target: the learning rate of ε = 1); `trainable_blocks`, `gradient_accumulation_steps`,
    `world_size`, `optim`, `probe_preconditioning`: the run's, read when given; `feature_norm`: `head_input_norm` of
    the model (None: 1); `public_width`: the width d of the head's input when public data can precondition it
    (None: no public data)."""
    out = Defaults()
    scope_given = bool(given & set(SCOPE_OPTIONS))
    probe = (trainable_blocks == 0) if scope_given else True
    if not scope_given:
        out.set("trainable_blocks", 0, "a linear probe on the frozen pretrained backbone, its features computed once: "
                                       "the noise falls on the head's few coordinates")
    if probe and "head_init" not in given and not scope_given:
        out.set("head_init", "zeros", "a zero-initialised head, known to help under DP")
    lr_given = "learning_rate" in given
    preconditioning = probe_preconditioning if "probe_preconditioning" in given else "none"
    if probe and public_width and "probe_preconditioning" not in given:
        preconditioning = "standardize"
        out.set("probe_preconditioning", preconditioning, "the head's inputs standardised with the public images' "
                "per-feature mean and std (no ε: public data only; folded into the saved head): DP noise is spread "
                "evenly over inputs that vary alike")
    if probe and not given & {"clipping", "adaptive_clipping"}:  # adaptive clipping follows a quantile: flat only
        out.set("clipping", "automatic", "every example's gradient scaled to norm about C (Bu et al. 2023): examples "
                                         "the head already fits still count, which helped at small ε")
    batch = _set_batch(out, n, given, None if probe else MICRO_BATCH, gradient_accumulation_steps, world_size,
                       "when blocks train")
    if not given & set(STEP_OPTIONS):
        epochs = PROBE_EPOCHS if probe else FINE_TUNE_EPOCHS
        out.set("num_train_epochs", epochs, f"about {epochs * max(1, n // batch)} steps; "
                + ("a probe's steps are cheap on cached features" if probe else "each step runs the trained blocks"))
    if "optim" not in given:
        out.set("optim", "sgd" if probe else "adamw_torch",
                "plain SGD for a probe (Adam would rescale every coordinate's noise to a full step)" if probe else
                "AdamW for blocks (large-batch DP fine-tuning, Li et al. 2022)")
    if not lr_given:
        sgd = (optim if "optim" in given else out.values["optim"]) == "sgd"
        if sgd:
            standardised = probe and public_width and preconditioning != "none"
            scale = public_width ** 0.5 if standardised else feature_norm or 1.0
            factor = STANDARDISED_LR_FACTOR if standardised else 1.0
            lr = factor * min(PROBE_MAX_LR, PROBE_LR_PER_EPSILON * (epsilon or 1.0)) / scale
            out.set("learning_rate", float(f"{lr:.3g}"),
                    (f"{factor:g} × " if standardised else "")
                    + f"{PROBE_LR_PER_EPSILON:g}·ε / s (at most {PROBE_MAX_LR:g} / s), s = {scale:.3g} the scale "
                    + (f"of the head's standardised input (√d, d = {public_width} inputs of unit variance on the "
                       "public images; the factor chosen on validation images)" if standardised else
                       "of the head's input on data-free inputs (images: a black vs a white one)")
                    + ": the best learning rate grows about linearly with ε, and a step moves the logits by about "
                    "lr·C·s")
        else:
            lr = FINE_TUNE_LR if not probe else ADAM_PROBE_LR
            out.set("learning_rate", lr, "Adam's step under DP noise, with a large batch" if not probe else
                    "an Adam-type probe's (recipes/configs/minilm_stdlib_topics_eps8.yaml)")
    return out


def _set_batch(out: Defaults, n: int, given: set[str], micro: int | None, gradient_accumulation_steps: int,
               world_size: int, why_micro: str) -> int:
    """Choose the expected batch (a quarter of n within `MIN_BATCH`-`MAX_BATCH`) as per-device batch × accumulation
    (micro-batches of `micro`; None: one micro-batch) unless the user gave the batch; returns the expected batch."""
    batch = min(n, max(MIN_BATCH, min(MAX_BATCH, round(PROBE_SAMPLE_RATE * n))))
    if "per_device_train_batch_size" not in given:
        accumulation = gradient_accumulation_steps if "gradient_accumulation_steps" in given else 1
        if micro is not None and "gradient_accumulation_steps" not in given and batch > micro:
            accumulation = max(1, batch // micro)
            out.set("gradient_accumulation_steps", accumulation, f"micro-batches of {micro} {why_micro}")
        per_device = max(1, min(micro or batch, batch // (max(accumulation, 1) * max(world_size, 1))))
        out.set("per_device_train_batch_size", per_device,
                f"expected batch {per_device * max(accumulation, 1) * max(world_size, 1)} of n = {n} "
                f"(q ≈ {PROBE_SAMPLE_RATE:g}, within {MIN_BATCH}-{MAX_BATCH}): the update's noise is σC/B and σ grows "
                "more slowly than B")
    return batch


# ---- language models (`train lm|sft|dpo`) ----------------------------------------------------------------------
def choose_language(n: int, given: set[str], parameters: int, pretrained: bool, peft_available: bool,
                    use_lora: bool | None = None, gradient_accumulation_steps: int = 1,
                    world_size: int = 1) -> Defaults:
    """The language recipes' rule, for `n` private units (documents, users or rows), a model of `parameters`
    parameters, `pretrained` or not: the scope (`use_lora`: LoRA adapters for a pretrained model of at least
    `LORA_MIN_PARAMETERS` when peft is installed, else every parameter; a scope or `use_lora` given is kept), the
    expected batch of the classifiers' rule in micro-batches of `LANGUAGE_MICRO_BATCH`, `FINE_TUNE_EPOCHS` epochs,
    AdamW at `LORA_LR` (adapters) or `FINE_TUNE_LR` (every parameter). ε and δ enter through σ, which the plan
    calibrates for the batch and steps chosen here.

        >>> chosen = choose_language(2000, set(), parameters=360_000_000, pretrained=True, peft_available=True)
        >>> chosen.values["use_lora"], chosen.values["learning_rate"], chosen.values["gradient_accumulation_steps"]
        (True, 0.001, 62)
        >>> choose_language(2000, {"use_lora"}, 360_000_000, True, True, use_lora=False).values["learning_rate"]
        0.0005
    """
    out = Defaults()
    if not given & {*SCOPE_OPTIONS, "use_lora"}:
        use_lora = pretrained and peft_available and parameters >= LORA_MIN_PARAMETERS
        out.set("use_lora", use_lora, f"the model has {parameters:,} parameters"
                + (", pretrained: LoRA adapters (few trained coordinates to spread the noise over, and no "
                   "per-example gradient of the base weights)" if use_lora else
                   (": every parameter trains" + ("" if pretrained else " (built here, not pretrained)")
                    + ("" if peft_available else "; peft is not installed")
                    + f" (LoRA from {LORA_MIN_PARAMETERS / 1e6:.0f} M pretrained parameters)")))
    _set_batch(out, n, given, LANGUAGE_MICRO_BATCH, gradient_accumulation_steps, world_size, "sequences")
    if not given & set(STEP_OPTIONS):
        out.set("num_train_epochs", FINE_TUNE_EPOCHS, "a few tens of large-batch steps (each step sees a quarter of "
                                                      "the units)")
    if "optim" not in given:
        out.set("optim", "adamw_torch", "AdamW: large-batch DP fine-tuning of language models (Li et al. 2022)")
    if "learning_rate" not in given:
        out.set("learning_rate", LORA_LR if use_lora else FINE_TUNE_LR,
                "LoRA's usual DP rate, the recipe's SmolLM2 command (not measured here)" if use_lora else
                "Li et al. 2022's rate for full DP fine-tuning with a large batch")
    return out


def fill_in_language(training_args, script_args, n: int, model, pretrained: bool) -> Defaults:
    """What `train lm|sft|dpo` call: unless `--dp_defaults off`, `choose_language` for the `n` private units
    and `model`, set on `training_args` (and `use_lora` on `script_args`). Returns what was chosen, for the plan."""
    import importlib.util

    if script_args.dp_defaults == "off":
        return Defaults(off=True)
    args = training_args
    defaults = choose_language(n, script_args.given_options, parameter_count(model), pretrained,
                               importlib.util.find_spec("peft") is not None, script_args.use_lora,
                               args.gradient_accumulation_steps, args.world_size)
    if "use_lora" in defaults.values:
        script_args.use_lora = defaults.values["use_lora"]
    apply(args, Defaults({k: v for k, v in defaults.values.items() if k != "use_lora"}))
    return defaults


def parameter_count(model) -> int:
    """The parameters of `model`, or of the causal LM a Hub name or folder names (built on the meta device from its
    config: nothing is downloaded but the config, no memory is used)."""
    if not isinstance(model, str):
        return sum(p.numel() for p in model.parameters())
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())


def apply(training_args, defaults: Defaults) -> None:
    """Set the chosen values on `training_args` (a `DPTrainingArguments`), as parsing would have."""
    from transformers.training_args import OptimizerNames

    for name, value in defaults.values.items():
        setattr(training_args, name, OptimizerNames(value) if name == "optim" else value)


def fill_in(training_args, n: int, given: set[str], switch: str = "on", model=None,
            blank_inputs: dict | None = None, public_data: bool = False) -> Defaults:
    """What a classification recipe calls before its checks: unless `switch` (`--dp_defaults`) is "off", choose the
    defaults for the `n` private examples (with the feature scale of `model` on `blank_inputs`, a data-free batch of
    one; `public_data`: public inputs can precondition the probe) and set them on `training_args`. Returns what was
    chosen and why, for the plan (`describe()`)."""
    if switch == "off":
        return Defaults(off=True)
    args = training_args
    scale = head_input_norm(model, blank_inputs) if model is not None and blank_inputs is not None else None
    width = head_input_width(model) if public_data and model is not None else None
    defaults = choose(n, args.target_epsilon, given, args.trainable_blocks, args.gradient_accumulation_steps,
                      args.world_size, getattr(args.optim, "value", args.optim), scale, width,
                      args.probe_preconditioning)
    apply(args, defaults)
    return defaults


def head_input_width(model) -> int:
    """d: the number of inputs of the model's task head (its first linear layer's)."""
    from hf_dp_repr.scope.blocks import head_modules

    head = head_modules(model)[0][1]
    return next(m for m in head.modules() if hasattr(m, "in_features")).in_features


def head_input_norm(model, blank_inputs: dict) -> float:
    """The L2 norm of what the model's task head reads, on `blank_inputs`: a data-free batch of one (an all-zero
    `pixel_values`, i.e. the normalisation mean's grey image; the tokenization of an empty text); with a batch of two
    (the image recipe's black and white images), the distance between what the head reads on the two: the scale
    along which inputs differ, without the part every input shares (most of DINOv2-S's head input: 72 for the grey
    image, 22.6 between black and white). A public quantity: it depends on the pretrained weights only. The model is
    run in eval mode, without gradients, and left as found.

        >>> from hf_dp_repr.tiny import tiny_vit
        >>> import torch
        >>> head_input_norm(tiny_vit(num_labels=2), {"pixel_values": torch.zeros(1, 1, 8, 8)}) > 0
        True
        >>> head_input_norm(tiny_vit(num_labels=2), {"pixel_values": torch.zeros(2, 1, 8, 8)})  # two equal inputs
        0.0
    """
    import torch

    from hf_dp_repr.scope.blocks import head_modules

    head = head_modules(model)[0][1]
    seen = []
    hook = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(**blank_inputs)
    finally:
        hook.remove()
        model.train(training)
    if len(seen[0]) >= 2:  # two data-free inputs: how far apart the head's inputs of two different inputs lie
        rows = seen[0].float().reshape(len(seen[0]), -1)
        return float((rows[1] - rows[0]).norm())
    return float(seen[0].float().reshape(-1, seen[0].shape[-1]).norm(dim=-1).mean())


def blank_text(tokenizer) -> dict:
    """The data-free text input of `head_input_norm`: an empty text's tokens (its special tokens), or the pad token
    alone for a tokenizer that adds none (GPT-2's)."""
    import torch

    ids = tokenizer("")["input_ids"] or [tokenizer.pad_token_id]
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
