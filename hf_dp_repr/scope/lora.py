"""LoRA (PEFT) under DP-SGD: wrap a model for `DPTrainer`, check that every trainable parameter gets exact
per-example gradients, and save the adapters merged into a plain HF model.

`DPTrainer(model, args, train_dataset, peft_config=LoraConfig(...))` calls `apply_peft_config`; an already
wrapped `PeftModel` can be passed as `model` instead (check it with `check_peft_model`). DP-SGD then runs on
the adapter parameters (and any `modules_to_save`, e.g. the classification head) only; the base weights are
frozen and stay bit-identical. `trainer.save_model()` saves the adapters alone (load them with
`PeftModel.from_pretrained(base, path)`); `trainer.save_merged_model()` saves base + adapters merged as a
plain HF model (`AutoModel...from_pretrained(path)`).

Why this is exact. Opacus computes per-example gradients with hooks on the modules that own trainable
parameters. Vanilla LoRA computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`, with `lora_A`/`lora_B`
plain `nn.Linear` (or `nn.Conv2d`) modules called on the batch, so Opacus' own Linear/Conv rules apply.
LoRA variants that read `lora_A.weight`/`lora_B.weight` outside those calls (DoRA, and the other
`lora_variant`s), adapters on embeddings or `nn.Parameter`s, merged or disabled adapters, or data-dependent
initialisations (EVA, CorDA, LoRA-GA look at training data before DP-SGD starts) would make the gradients
wrong or the accounting incomplete: they are refused with an error that names the fix.

Example (runs in seconds on a CPU):
    >>> import torch
    >>> from peft import LoraConfig
    >>> from hf_dp_repr import DPTrainer, DPTrainingArguments
    >>> from hf_dp_repr.tiny import tiny_gpt2
    >>> from datasets import Dataset
    >>> ids = torch.randint(1, 128, (32, 8))
    >>> data = Dataset.from_dict({"input_ids": ids, "labels": ids}).with_format("torch")
    >>> args = DPTrainingArguments(output_dir="/tmp/dp-lora-doc", target_epsilon=8.0, target_delta=1e-3,
    ...     per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3, report_to="none",
    ...     save_strategy="no", disable_tqdm=True)
    >>> lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM")
    >>> trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=data, peft_config=lora)
    >>> out = trainer.train()  # doctest: +ELLIPSIS
    {...'epsilon': ...}
    >>> trainer.save_model("/tmp/dp-lora-doc/adapters")        # adapters only (+ ledger, model card)
    >>> trainer.save_merged_model("/tmp/dp-lora-doc/merged")   # plain GPT2LMHeadModel
    >>> from transformers import GPT2LMHeadModel
    >>> type(GPT2LMHeadModel.from_pretrained("/tmp/dp-lora-doc/merged")).__name__
    'GPT2LMHeadModel'
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import Counter

from torch import nn

from ..errors import ArgumentTypeError, DPConfigError, NotPrivatizableError, UnsupportedError

# LoraConfig fields whose non-default values are verified to give exact per-example gradients (and no data
# access outside DP-SGD). Any other LoraConfig field set away from its default is refused: new PEFT options
# are LoRA variants or data-dependent initialisations until a brute-force test says otherwise.
_ALLOWED_LORA_FIELDS = frozenset({
    "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "fan_in_fan_out", "bias",
    "use_rslora", "modules_to_save", "init_lora_weights", "layers_to_transform", "layers_pattern",
    "rank_pattern", "alpha_pattern", "lora_bias", "runtime_config", "ensure_weight_tying",
})
# Data-independent initialisations that leave the base weights untouched.
_ALLOWED_INITS = (True, False, "gaussian")
# Task heads that DP fine-tuning of a classifier should train (through `modules_to_save`).
_HEAD_NAMES = ("classifier", "score")


def _peft():
    try:
        import peft
    except ImportError as e:  # pragma: no cover - peft is a dependency
        raise ImportError("LoRA under DP needs the `peft` package: `pip install peft`.") from e
    return peft


def has_peft_adapters(model) -> bool:
    """The one test for "PEFT decides what trains": a `PeftModel`, or a transformers model with adapters loaded
    (`load_adapter`); both carry `peft_config`. (`is_peft_model`: only the former can `merge_and_unload`.)"""
    return hasattr(model, "peft_config")


def is_peft_model(model) -> bool:
    """A `peft.PeftModel` wrapper (what `save_merged_model` can merge)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


def apply_peft_config(model: nn.Module, peft_config) -> nn.Module:
    """Wrap `model` with `peft.get_peft_model(model, peft_config)` for DP-SGD and return the PeftModel.

    Only LoRA is supported (its per-example gradients are verified against brute force). The config is
    copied, never mutated; `fan_in_fan_out` is set for GPT-2's transformers `Conv1D` layers. Like
    `get_peft_model`, this injects the adapter layers into `model` in place: use the returned model.
    Raises `TypeError`/`ValueError` naming the fix for a wrong config type, target modules that match
    nothing (listing the model's candidate layer names), a model that is already a PeftModel, and LoRA
    options whose per-example gradients would be wrong.
    """
    peft = _peft()
    if not isinstance(peft_config, peft.PeftConfig):
        raise ArgumentTypeError(
            f"DPTrainer: peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}. "
            "Fix: peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=[...])."
        )
    if not isinstance(peft_config, peft.LoraConfig):
        raise NotPrivatizableError(
            f"DPTrainer: only LoRA is supported under DP-SGD, got {type(peft_config).__name__} "
            f"({peft_config.peft_type}). Its per-example gradients are not verified; use peft.LoraConfig."
        )
    if is_peft_model(model):
        raise DPConfigError(
            "DPTrainer: the model is already a PeftModel and a peft_config was given too. Fix: pass the "
            "PeftModel alone (DPTrainer(model=peft_model, ...) trains its active adapter), or merge it first "
            "(`model = model.merge_and_unload()`) and then pass the new peft_config."
        )
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"DPTrainer: peft_config needs a torch model to wrap, got {type(model).__name__}.")
    config = copy.deepcopy(peft_config)
    _check_lora_config(config)
    _check_targets_before_wrapping(model, config)
    try:
        with warnings.catch_warnings():
            # PEFT's own notes on fan_in_fan_out are handled above and only concern layers it fixes itself.
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to")
            # PeftModel reads transformers 5's deprecated `is_gradient_checkpointing` (peft's code, not ours): the
            # FutureWarning asks the user for nothing
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        # PEFT >= 0.18 raises NoMatchingPeftModuleError (a ValueError), e.g. with modules_to_save set too.
        if "not found in the base model" in str(e) or type(e).__name__ == "NoMatchingPeftModuleError":
            problem = "match no layer of"
        elif "is not supported" in str(e):
            problem = "include a layer type that LoRA cannot wrap in"
        else:
            raise
        raise DPConfigError(
            f"DPTrainer: LoRA target modules {_describe_targets(config)} {problem} {type(model).__name__}. "
            "Fix: set LoraConfig(target_modules=[...]) to leaf names of its layers; candidates (leaf name: "
            f"count type): {candidate_target_modules(model)}."
        ) from e
    check_peft_model(wrapped)
    return wrapped


def check_peft_model(model) -> None:
    """Raise `NotPrivatizableError` (a ValueError) naming the fix unless DP-SGD gets exact per-example gradients for
    every trainable parameter of the PeftModel `model`: LoRA adapters only, no LoRA variant (DoRA, ...), adapters
    not merged or disabled, every trainable parameter owned by a module with an Opacus per-sample-gradient rule.
    Warns when a classification head stays frozen."""
    peft = _peft()
    from opacus.grad_sample import GradSampleModule

    if not is_peft_model(model):
        raise ArgumentTypeError(f"check_peft_model: expected a peft.PeftModel, got {type(model).__name__}.")
    for name, cfg in model.peft_config.items():
        if not isinstance(cfg, peft.LoraConfig):
            raise NotPrivatizableError(
                f"DPTrainer: adapter {name!r} is {type(cfg).__name__}; only LoRA adapters are supported under "
                "DP-SGD (their per-example gradients are verified). Fix: use peft.LoraConfig, or delete that "
                "adapter (`model.delete_adapter(name)`)."
            )
        _check_lora_config(cfg, adapter=name)
    from peft.tuners.lora import LoraLayer

    problems = []
    for path, module in model.named_modules():
        if isinstance(module, LoraLayer):
            if getattr(module, "merged", False):
                problems.append(f"{path}: adapters are merged into the base weights, so the LoRA layers never run "
                                "and get no gradient. Fix: `model.unmerge_adapter()` before training.")
            if getattr(module, "disable_adapters", False):
                problems.append(f"{path}: adapters are disabled. Fix: `model.enable_adapter_layers()`.")
            variants = getattr(module, "lora_variant", {}) or {}
            if variants:
                kinds = sorted({type(v).__name__ for v in variants.values()})
                problems.append(f"{path}: LoRA variant {kinds} uses the adapter weights outside the lora_A/lora_B "
                                "layers, so per-example gradients would be wrong. Fix: plain LoRA (use_dora=False).")
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if own and type(module) not in GradSampleModule.GRAD_SAMPLERS:
            problems.append(
                f"{path or '<root>'} ({type(module).__name__}) trains {own} but has no per-example gradient rule. "
                "Fix: remove it from target_modules/modules_to_save (LoRA on embeddings or on nn.Parameter "
                "targets is not supported under DP), or freeze it."
            )
    if problems:
        raise NotPrivatizableError("DPTrainer: this PEFT model cannot be trained exactly with DP-SGD:\n  - "
                                   + "\n  - ".join(problems))
    if not any(p.requires_grad for p in model.parameters()):
        raise DPConfigError("DPTrainer: the PEFT model has no trainable parameter (inference_mode=True, or adapters "
                            "frozen). Fix: LoraConfig(inference_mode=False) or `PeftModel.from_pretrained(..., "
                            "is_trainable=True)`.")
    _warn_frozen_head(model)


def merged_copy(model) -> nn.Module:
    """A copy of `model` (a PeftModel) with its adapters merged into the base weights: a plain HF model that saves
    and loads without peft (peak memory: two models); the training model, its adapters and its base weights are left
    untouched. Refused while a parameter holds per-example gradients. The copy may carry the DP bookkeeping the
    trainer attached to the parameters: `DPTrainer.save_merged_model` clears it before saving."""
    params = list(model.parameters())
    stale = [getattr(p, "_dp_name", "?") for p in params if getattr(p, "grad_sample", None) is not None]
    if stale:
        raise UnsupportedError(f"save_merged_model: parameters {stale[:3]} still hold per-example gradients; "
                               "save after the training step (DPTrainer detaches its hooks after train()).")
    return copy.deepcopy(model).merge_and_unload(safe_merge=True)


def candidate_target_modules(model: nn.Module) -> str:
    """The leaf names of the layers LoRA can target under DP (Linear, transformers' Conv1D, Conv2d), with
    their counts and types, e.g. "c_attn: 2 Conv1D, c_proj: 4 Conv1D, ..."."""
    from transformers.pytorch_utils import Conv1D

    counts: Counter = Counter()
    for name, module in model.named_modules():
        if name and isinstance(module, (nn.Linear, Conv1D, nn.Conv2d)) and not _inside_peft_layer(name):
            counts[(name.rsplit(".", 1)[-1], type(module).__name__)] += 1
    if not counts:
        return "none (the model has no Linear, Conv1D or Conv2d layer)"
    return ", ".join(f"{leaf}: {n} {kind}" for (leaf, kind), n in counts.items())


# ---- helpers ----------------------------------------------------------------------------------------------
def _check_lora_config(config, adapter: str | None = None) -> None:
    where = f" (adapter {adapter!r})" if adapter else ""
    init = config.init_lora_weights
    if not any(init is ok or (isinstance(init, str) and init == ok) for ok in _ALLOWED_INITS):
        raise NotPrivatizableError(
            f"DPTrainer: LoraConfig{where} init_lora_weights={init!r} is not supported under DP-SGD: EVA, CorDA and "
            "LoRA-GA initialise from training data (a release no accountant counts); PiSSA, OLoRA, LoftQ and the "
            "others rewrite the base weights. Fix: init_lora_weights=True (default), False or 'gaussian'."
        )
    changed = []
    for f in dataclasses.fields(type(config)):
        if f.name in _ALLOWED_LORA_FIELDS or not f.init or not _is_lora_field(f):
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        value = getattr(config, f.name, default)
        if value != default and not (value in (None, False) and default in (None, False)):
            changed.append(f"{f.name}={value!r}")
    if changed:
        raise NotPrivatizableError(
            f"DPTrainer: LoraConfig{where} sets {', '.join(changed)}. These LoRA variants/initialisations are not "
            "supported under DP-SGD: they use the adapter weights outside the lora_A/lora_B layers (per-example "
            "gradients would be silently wrong), quantise or rewrite the base weights, or look at training "
            "data outside the private training. Fix: remove them (plain LoRA: r, lora_alpha, lora_dropout, "
            "target_modules, modules_to_save, use_rslora, bias, lora_bias are supported)."
        )
    if config.inference_mode and adapter is None:
        raise DPConfigError(f"DPTrainer: LoraConfig{where} has inference_mode=True, which freezes the adapters. "
                            "Fix: inference_mode=False.")


def _is_lora_field(f: dataclasses.Field) -> bool:
    """Fields declared by LoraConfig itself, not those of PeftConfig (peft_type, task_type, base model, ...)."""
    peft = _peft()
    return f.name not in {g.name for g in dataclasses.fields(peft.PeftConfig)}


def _check_targets_before_wrapping(model: nn.Module, config) -> None:
    """Refuse, before PEFT injects anything into `model`, targets and modules_to_save whose per-example
    gradients DP-SGD cannot compute exactly; and set `fan_in_fan_out` for GPT-2's transformers Conv1D (stored
    as (in, out)) when all targets agree (PEFT fixes mixed models layer by layer, with a warning)."""
    from opacus.grad_sample import GradSampleModule
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers.pytorch_utils import Conv1D

    kinds, bad = set(), []
    if config.target_modules is not None:
        for name, module in model.named_modules():
            if not name or not check_target_module_exists(config, name):
                continue
            if isinstance(module, (nn.Linear, Conv1D, nn.Conv2d)):
                kinds.add(isinstance(module, Conv1D))
            elif any(True for _ in module.parameters(recurse=False)):
                bad.append(f"{name} ({type(module).__name__})")
    if bad:
        raise NotPrivatizableError(
            f"DPTrainer: LoRA target modules {_describe_targets(config)} match {', '.join(bad[:5])}: under DP only "
            "Linear, transformers' Conv1D and Conv2d layers can carry LoRA adapters (elsewhere PEFT uses the adapter "
            "weights outside a layer with a per-example gradient rule). Fix: target only those; candidates (leaf "
            f"name: count type): {candidate_target_modules(model)}."
        )
    for key in config.modules_to_save or []:
        for name, module in model.named_modules():
            if name == key or name.endswith("." + key):
                unsupported = sorted({type(m).__name__ for m in module.modules()
                                      if next(m.parameters(recurse=False), None) is not None
                                      and type(m) not in GradSampleModule.GRAD_SAMPLERS})
                if unsupported:
                    raise NotPrivatizableError(
                        f"DPTrainer: modules_to_save entry {key!r} ({name}) contains {unsupported}, which have no "
                        "per-example gradient rule under DP-SGD. Fix: choose modules made of Linear, Conv, "
                        "LayerNorm or Embedding layers (e.g. the task head)."
                    )
    if len(kinds) == 1:
        config.fan_in_fan_out = kinds.pop()


def _describe_targets(config) -> str:
    targets = config.target_modules
    if isinstance(targets, (set, frozenset)):
        targets = sorted(targets)
    return repr(targets)


def _inside_peft_layer(name: str) -> bool:
    parts = name.split(".")
    return any(p in ("lora_A", "lora_B", "base_layer", "original_module", "modules_to_save") for p in parts)


def _warn_frozen_head(model) -> None:
    base = model.get_base_model()
    for head in _HEAD_NAMES:
        module = getattr(base, head, None)
        if isinstance(module, nn.Module) and not any(p.requires_grad for p in module.parameters()):
            warnings.warn(
                f"DPTrainer: the task head `{head}` of {type(base).__name__} stays frozen (LoRA trains only the "
                f"adapters). A randomly initialised head will not learn. Fix: LoraConfig(modules_to_save=['{head}']) "
                "or task_type='SEQ_CLS' for sequence classification.",
                stacklevel=3,
            )
            return
