"""Sharded DP-SGD in `DPTrainer`: the Trainer's own switch, `DPTrainingArguments(fsdp=True, fsdp_config={"fsdp_version":
2, ...})` (`--fsdp --fsdp_config '{"fsdp_version": 2}'` in the recipes), or a model that arrives sharded
(`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W))`).

DPTrainer shards the model itself (`privacy.sharding.shard_model`: each block class, then the root), on CPU/gloo
(where accelerate ignores FSDP) and on GPU/NCCL alike, and hands it to the Trainer under transformers' contract for
models sharded at load time (`is_distributed_loading_by_transformers`: no DDP wrap, no second sharding, every rank
joins the saves); accelerate's FSDP plugin is never built. What cannot be made private or exact under sharding is
refused here, before any work, naming the fix:

- accelerate's FSDP plugin (`ACCELERATE_USE_FSDP`, set by an accelerate FSDP config) and DeepSpeed (`deepspeed=`,
  `ACCELERATE_USE_DEEPSPEED`): they own the backward and reduce the unclipped gradient;
- FSDP1 (flat parameters), CPU offload, XLA, FSDP activation checkpointing, sharded state dicts, size-based wrapping,
  any fsdp_config key not listed in `FSDP_CONFIG`;
- the Opacus hooks engine, cached features, gradient checkpointing (privacy units run: each micro-batch holds
  whole units, which the ghost engine clips as one, `privacy.units`);
- torch < 2.9 (`privacy.sharding.check_torch_supports_sharding`), one process without a process group.

Example:
    >>> from hf_dp_repr.training.sharding import parse_fsdp
    >>> parse_fsdp("full_shard", {"fsdp_version": 2})
    ShardingRequest(reshard_after_forward=True, block_classes=None)
    >>> parse_fsdp(True, {"version": 1})
    Traceback (most recent call last):
    hf_dp_repr.errors.DPConfigError: DPTrainingArguments: fsdp_config version 1 (FSDP1, flat parameters) ...
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

from ..errors import DPConfigError

_FIX = ("Fix: fsdp=True with fsdp_config={'fsdp_version': 2} (optionally 'reshard_after_forward' and "
        "'transformer_layer_cls_to_wrap'), launched with a multi-process accelerate config "
        "(recipes/accelerate_configs/cpu_2proc.yaml, multi_gpu_sharded.yaml) or torchrun.")
_TRUE = ("1", "true", "yes")
# why DeepSpeed is refused: here, where sharding is decided; arguments.fields refuses the field with it
DEEPSPEED_REASON = ("DeepSpeed owns the backward and the optimizer step: ZeRO reduces the gradient autograd forms in "
                    "its own hooks into private partitioned buffers and may skip steps under loss scaling, while "
                    "DP-SGD forms no unclipped gradient and must release exactly the clipped, noised sum. FSDP2 gives "
                    "the same memory (ZeRO-3: reshard_after_forward=True, ZeRO-2: False) through public APIs: use "
                    "fsdp=True, fsdp_config={'fsdp_version': 2}.")


def _is_true(value) -> bool:
    return str(value).strip().lower() in _TRUE


# fsdp_config keys (after transformers strips "fsdp_") → the values sharded DP-SGD accepts. Any other key is refused.
FSDP_CONFIG = {
    "version": lambda v: int(v) == 2,
    "reshard_after_forward": lambda v: str(v).lower() in ("true", "false", "full_shard", "shard_grad_op"),
    "transformer_layer_cls_to_wrap": lambda v: True,
    "auto_wrap_policy": lambda v: v in ("TRANSFORMER_BASED_WRAP", "NO_WRAP"),
    "state_dict_type": lambda v: v == "FULL_STATE_DICT",
    "min_num_params": lambda v: int(v) == 0,
    "cpu_ram_efficient_loading": lambda v: not _is_true(v),
    "xla": lambda v: not _is_true(v),
    "xla_fsdp_v2": lambda v: not _is_true(v),
    "xla_fsdp_grad_ckpt": lambda v: not _is_true(v),
}
_WHY_KEY = {
    "version": "FSDP1 (flat parameters) hides the per-tensor parameters the per-example clipping rules read",
    "state_dict_type": "checkpoints are plain HF models gathered on rank 0 (resume restores them exactly)",
    "min_num_params": "size-based wrapping; DPTrainer wraps each block class",
    "auto_wrap_policy": "size-based wrapping; DPTrainer wraps each block class (TRANSFORMER_BASED_WRAP)",
    "cpu_ram_efficient_loading": "accelerate's loading path, which DPTrainer does not use; load the model sharded "
                                 "with from_pretrained(distributed_config=DistributedConfig(fsdp_size=W)) instead",
    "xla": "XLA FSDP is not supported", "xla_fsdp_v2": "XLA FSDP is not supported",
    "xla_fsdp_grad_ckpt": "XLA FSDP is not supported",
}
_LEGACY = {"full_shard": True, "shard_grad_op": False, "auto_wrap": None}  # `fsdp="..."` words → reshard_after_forward


@dataclass(frozen=True)
class ShardingRequest:
    """How DPTrainer shards: `reshard_after_forward` (True: ZeRO-3-like, False: keep gathered until the backward)
    and the block classes to wrap (None: the model's `_no_split_modules`; empty: the root alone, one group)."""

    reshard_after_forward: bool = True
    block_classes: tuple[str, ...] | None = None


def check_launcher_environment() -> None:
    """accelerate's FSDP and DeepSpeed plugins, switched on by an accelerate config through the environment."""
    if _is_true(os.environ.get("ACCELERATE_USE_DEEPSPEED", "")):
        raise DPConfigError("DPTrainingArguments: ACCELERATE_USE_DEEPSPEED=true (an accelerate DeepSpeed config) is "
                            f"refused under DP-SGD: {DEEPSPEED_REASON} {_FIX}")
    if _is_true(os.environ.get("ACCELERATE_USE_FSDP", "")):
        raise DPConfigError("DPTrainingArguments: ACCELERATE_USE_FSDP=true (an accelerate FSDP config) is refused "
                            "under DP-SGD: accelerate's FSDP plugin shards the model itself and reduce-scatters the "
                            "unclipped gradient (and on CPU it is ignored: the run would be plain DDP). DPTrainer "
                            f"shards with FSDP2 itself. {_FIX}")


def parse_fsdp(fsdp, fsdp_config) -> ShardingRequest | None:
    """The sharding `fsdp` and `fsdp_config` ask for (None: no sharding), or DPConfigError for what sharded DP-SGD
    cannot honour. Takes the values as the user wrote them or as transformers normalised them."""
    if not fsdp:
        return None
    if isinstance(fsdp, str) and fsdp.strip().lower() in ("false", "0", "no"):
        return None
    config = fsdp_config or {}
    if isinstance(config, str) and config.lstrip().startswith("{"):  # JSON on the command line, as the Trainer reads it
        config = json.loads(config)
    elif isinstance(config, str):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    config = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in config.items()}
    reshard = config.get("reshard_after_forward", True)
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else []
    for word in words:
        if word not in _LEGACY:
            raise DPConfigError(f"DPTrainingArguments: fsdp={fsdp!r}: {word!r} is not supported by sharded DP-SGD "
                                f"(FSDP2 full_shard or shard_grad_op only; no offload, no hybrid sharding). {_FIX}")
        if _LEGACY[word] is not None and "reshard_after_forward" not in config:
            reshard = _LEGACY[word]
    for key, value in config.items():
        allowed = FSDP_CONFIG.get(key)
        if allowed is None or not allowed(value):
            why = _WHY_KEY.get(key, "not supported by sharded DP-SGD (offload, mixed precision, activation "
                                    "checkpointing and FSDP1 options are refused)")
            label = f"version {value}" if key == "version" else f"{key}={value!r}"
            if key == "version":
                label += " (FSDP1, flat parameters)"
            raise DPConfigError(f"DPTrainingArguments: fsdp_config {label} is refused: {why}. {_FIX}")
    classes = config.get("transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [c.strip() for c in classes.split(",")]
    if config.get("auto_wrap_policy") == "NO_WRAP":
        classes = []  # the root alone: one group
    reshard = reshard if isinstance(reshard, bool) else str(reshard).lower() in ("true", "full_shard")
    return ShardingRequest(reshard_after_forward=reshard, block_classes=None if classes is None else tuple(classes))


def sharding_request(args) -> ShardingRequest | None:
    """The request of `args` (DPTrainingArguments), with the DP arguments that cannot run sharded refused."""
    check_launcher_environment()
    request = parse_fsdp(getattr(args, "fsdp", None), getattr(args, "fsdp_config", None))
    if request is not None:
        check_dp_arguments_for_sharding(args)
    return request


def check_dp_arguments_for_sharding(args) -> None:
    """The DP arguments a sharded run cannot honour (each refused with the reason)."""
    from ..privacy.sharding import check_torch_supports_sharding

    check_torch_supports_sharding()
    refused = [
        (args.clipping_engine == "hooks", "clipping_engine='hooks': Opacus' hooks store per-sample gradients on the "
         "sharded parameters, which the forward never uses, and need autograd's gradient, which FSDP2 would "
         "reduce-scatter unclipped. Use clipping_engine='ghost' (or 'auto')"),
        (bool(args.cache_features), "cache_features=True: cached features are computed by submodules called "
         "outside the sharded root's forward. Leave cache_features=None"),
        (bool(getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing),
         "gradient_checkpointing: the ghost engine (the one clipper that runs "
         "sharded) needs each module's forward inputs, which checkpointing recomputes. Turn it off"),
    ]
    for bad, why in refused:
        if bad:
            raise DPConfigError(f"DPTrainingArguments: with fsdp (sharded DP-SGD), {why}.")


def check_processes(args) -> None:
    """After the Trainer's arguments set up the processes: a sharded run needs a process group."""
    import torch.distributed as dist

    from ..errors import ProcessGroupError

    if sharding_request(args) is not None and not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupError("DPTrainingArguments: fsdp (sharded DP-SGD) needs several processes and this one "
                                f"runs alone (no torch.distributed process group). {_FIX}")


# ---- DPTrainer ----------------------------------------------------------------------------------------------
def shard_for_training(model, args, log):
    """The model DPTrainer trains: sharded here (fsdp=...), or already sharded (checked), or `model` unchanged.
    Marks a sharded model as transformers marks one sharded at load time (see the module docstring)."""
    from ..privacy.ghost_clipping import unsupported_reason
    from ..privacy.sharding import check_sharded_model, is_sharded, shard_model

    request = sharding_request(args)
    if request is None and not is_sharded(model):
        return model
    if model is None:
        raise DPConfigError("DPTrainer: fsdp (sharded DP-SGD) needs the model itself, not model_init: pass model=.")
    check_dp_arguments_for_sharding(args)
    reason = unsupported_reason(model)  # before sharding: nothing is done to a model that cannot run sharded
    if reason is not None:
        raise DPConfigError(f"DPTrainer: sharded DP-SGD clips with the ghost engine, which cannot clip this model "
                            f"exactly: {reason}. Train it without fsdp (clipping_engine='hooks').")
    if is_sharded(model):
        check_sharded_model(model)
        groups = "as loaded"
    else:
        request = request or ShardingRequest()
        groups = shard_model(model, request.block_classes, request.reshard_after_forward)
    _mark_sharded(model)
    if args.process_index == 0:
        import torch.distributed as dist

        where = groups if isinstance(groups, str) else f"{len(groups)} groups: {', '.join(groups[:4])}" + (
            " ..." if len(groups) > 4 else "")
        log.info(f"FSDP2: sharded over {dist.get_world_size()} processes ({where}); clipped sums reduce-scattered, "
                 "noise once per coordinate.")
    return model


def _mark_sharded(model) -> None:
    """transformers' marks of a model sharded at load time: the Trainer then neither wraps it in DDP nor shards it
    again, and every rank joins saves; its deferred-reduction context reads `config.distributed_config`."""
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base._is_distributed_loading_by_transformers = True
    if getattr(base.config, "distributed_config", None) is None:
        base.config.distributed_config = DistributedConfig(fsdp_size=dist.get_world_size())


@contextlib.contextmanager
def trainer_init(args, sharded: bool):
    """Around `Trainer.__init__` of a sharded run: the two reads listed in `hf_compat.HIDDEN_READS` see what a model
    sharded by DPTrainer needs (no "fsdp only works in distributed training", no "resuming is not supported":
    DPTrainer saves and restores the optimizer of a sharded model itself)."""
    if not sharded:
        yield
        return
    saved = args.fsdp, args.save_only_model
    args.fsdp, args.save_only_model = False, True
    try:
        yield
    finally:
        args.fsdp, args.save_only_model = saved


def check_trainer(trainer) -> None:
    """After `Trainer.__init__`: an Accelerator set up with an FSDP or DeepSpeed plugin elsewhere is refused."""
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        what = "FSDP" if trainer.is_fsdp_enabled else "DeepSpeed"
        raise DPConfigError(f"DPTrainer: accelerate is set up with its {what} plugin (an Accelerator made before "
                            "DPTrainer, or an accelerate config): it would reduce the unclipped gradient. " + _FIX)
