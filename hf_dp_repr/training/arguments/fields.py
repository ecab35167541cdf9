"""What `DPTrainer` does with every `transformers.TrainingArguments` field, in one table: honoured, irrelevant, or
refused with the reason. DP-SGD replaces the Trainer's training batches (Poisson sampling), its gradient step
(per-example clipping and noise) and its pushes, so a Trainer option about those would otherwise be ignored in
silence (e.g. `train_sampling_strategy="group_by_length"`, `dataloader_drop_last=True`).

`check_refused_fields(args)` raises `DPConfigError` for the first refused value, naming the argument, why and the
fix; `DPTrainingArguments.__post_init__` and `DPTrainer.__init__` call it. `tests/test_arguments.py` checks that
every field of the installed transformers has an entry, so a new Trainer option needs a decision here.

Example:
    >>> from hf_dp_repr import DPTrainingArguments
    >>> FIELDS["dataloader_drop_last"].decision, FIELDS["seed"].decision, FIELDS["do_train"].decision
    ('refused', 'honoured', 'irrelevant')
    >>> try:
    ...     DPTrainingArguments(output_dir="out", target_epsilon=8.0, report_to="none",
    ...                         train_sampling_strategy="group_by_length")
    ... except ValueError as err:
    ...     print(str(err)[:86])
    DPTrainingArguments: train_sampling_strategy='group_by_length' is refused under DP-SGD
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import DPConfigError
from ..sharding import DEEPSPEED_REASON


@dataclass(frozen=True)
class Field:
    decision: str  # "honoured", "irrelevant" or "refused"
    why: str
    allowed: Callable[[Any], bool] | None = None  # refused: the values that are still accepted


def _honoured(why: str) -> Field:
    return Field("honoured", why)


def _irrelevant(why: str) -> Field:
    return Field("irrelevant", why)


def _refused(allowed: Callable[[Any], bool], why: str) -> Field:
    return Field("refused", why, allowed)


def _value(v):
    return getattr(v, "value", v)  # an enum (IntervalStrategy, OptimizerNames, ...) as its string


_TRAINER = "the Trainer's own behaviour, unchanged"
_EVAL = "evaluation, which DPTrainer leaves to the Trainer (the guarantee covers the weights, not eval metrics)"
_LOGS = "the Trainer's logging (logs carry ε; the training loss they also carry is not covered by the guarantee)"
_SCHEDULE = "the Trainer's schedule (with lp_steps: a constant phase first, then this schedule)"
_OPTIMIZER = "the Trainer's optimizer, wrapped by the DP optimizer: it only ever sees clipped, noised gradients"
_SAVE = "the Trainer's checkpoints; DPTrainer adds the privacy ledger and the DP card to each"
_HUB = "pushes go through hf_dp_repr.hub's allow-list (weights, ledger, DP card, public metrics)"
_NO_DDP_SYNC = ("no DDP gradient sync happens under DPTrainer: every micro-batch runs under no_sync, and the DP "
                "optimizer all-reduces the clipped, noised sum itself")
_SCRIPTS = "read by scripts, not by the Trainer"
_SPLIT_MODEL = ("DP-SGD clips each example's whole gradient in one process: data parallelism (DDP) and FSDP2 "
                "sharding (fsdp=True, fsdp_config={'fsdp_version': 2}: each process clips its own examples with the "
                "gathered weights) are supported")

FIELDS: dict[str, Field] = {
    # ---- the run and its schedule ------------------------------------------------------------------------------
    "output_dir": _honoured("the run folder: weights, privacy ledger, DP card, checkpoints"),
    "per_device_train_batch_size": _honoured("the expected logical batch is per-device batch × accumulation × "
                                             "processes; it sets the sample rate q = batch / n"),
    "gradient_accumulation_steps": _honoured("micro-batches of one Poisson-sampled logical batch; noise once per step"),
    "num_train_epochs": _honoured("plans the steps σ is calibrated for (⌊n / batch⌋ steps per epoch)"),
    "max_steps": _honoured("plans the steps σ is calibrated for"),
    "auto_find_batch_size": _refused(lambda v: not v, (
        "auto_find_batch_size changes the sampling rate mid-run, which breaks the privacy accounting. Set "
        "per_device_train_batch_size and gradient_accumulation_steps yourself.")),
    "learning_rate": _honoured(_SCHEDULE),
    "lr_scheduler_type": _honoured(_SCHEDULE + "; a schedule that cannot be shifted past it is refused at train()"),
    "lr_scheduler_kwargs": _honoured(_SCHEDULE),
    "warmup_steps": _honoured(_SCHEDULE),
    # ---- the optimizer and the gradient ------------------------------------------------------------------------
    "optim": _refused(lambda v: not _value(v).endswith("layerwise") and _value(v) not in ("lomo", "adalomo")
                      and not _value(v).startswith("schedule_free"), (
        "this optimizer updates the weights inside the backward pass (lomo, adalomo, *_layerwise), before "
        "per-example clipping and noise, or needs train/eval mode switches the DP optimizer does not pass on "
        "(schedule_free_*). Use a step-based optimizer (adamw_torch, sgd, adafactor, galore_adamw, ...).")),
    "optim_args": _honoured(_OPTIMIZER),
    "optim_target_modules": _honoured(_OPTIMIZER + " (GaLore / APOLLO project the noised gradient)"),
    "weight_decay": _honoured(_OPTIMIZER),
    "adam_beta1": _honoured(_OPTIMIZER),
    "adam_beta2": _honoured(_OPTIMIZER),
    "adam_epsilon": _honoured(_OPTIMIZER),
    "max_grad_norm": _refused(lambda v: not v, (
        "it would clip the summed, non-private gradient and log its norm. Leave it at 0 and set "
        "per_sample_max_grad_norm for per-example clipping.")),
    "label_smoothing_factor": _honoured("applied per example by DPTrainer's loss"),
    "average_tokens_across_devices": _honoured("evaluation only (DP-SGD sums per-example losses itself); off by "
                                               "default under DP"),
    "neftune_noise_alpha": _refused(lambda v: v is None, (
        "NEFTune scales its embedding noise by the padded length of the whole batch, so one example's gradient "
        "depends on the other examples in its batch and clipping no longer bounds one example's influence.")),
    # ---- precision, memory and speed ---------------------------------------------------------------------------
    "bf16": _honoured("mixed precision without loss scaling; per-example clipping sees the true gradients"),
    "fp16": _refused(lambda v: not v, (
        "the Trainer's GradScaler multiplies the loss, hence every per-example gradient, by its loss scale before "
        "clipping, so per_sample_max_grad_norm would clip the scaled gradients (and on a CPU fp16 is ignored). Use "
        "bf16=True (no loss scaling) or full precision.")),
    "bf16_full_eval": _honoured(_EVAL),
    "fp16_full_eval": _honoured(_EVAL),
    "tf32": _honoured(_TRAINER),
    "activation_checkpointing": _honoured("with use_reentrant=True; the non-reentrant default hides activations "
                                          "from the per-example hooks and is refused after the Trainer resolves "
                                          "the gradient_checkpointing aliases (config.py)"),
    "activation_checkpointing_kwargs": _honoured("see activation_checkpointing"),
    "gradient_checkpointing": _honoured("see activation_checkpointing"),
    "gradient_checkpointing_kwargs": _honoured("see activation_checkpointing"),
    "torch_compile": _refused(lambda v: not v, (
        "per-example gradients (Opacus hooks, ghost norms) on a torch.compile'd model are not verified to be "
        "exact (compiled graphs and backward hooks); train uncompiled.")),
    "torch_compile_backend": _refused(lambda v: v is None, "it turns torch_compile on; see torch_compile."),
    "torch_compile_mode": _refused(lambda v: v is None, "it turns torch_compile on; see torch_compile."),
    "use_liger_kernel": _refused(lambda v: not v, (
        "Liger kernels replace the model's layers and fuse the loss into the head (no logits): DPTrainer needs "
        "per-example losses from the logits, and its per-example gradient rules are for torch's layers.")),
    "liger_kernel_config": _irrelevant("read only with use_liger_kernel, which is refused"),
    "use_cache": _honoured(_TRAINER),
    "torch_empty_cache_steps": _refused(lambda v: v is None, (
        "DPTrainer's training step replaces the Trainer's, which is where the cache would be emptied; it would "
        "be ignored. Leave it None.")),
    "use_cpu": _honoured(_TRAINER),
    # ---- training batches: Poisson sampling replaces the Trainer's sampler -------------------------------------
    "train_sampling_strategy": _refused(lambda v: _value(v) == "random", (
        "DPTrainer draws every training batch by Poisson sampling (poisson_sampling=False: shuffled fixed-size "
        "batches, not a proven guarantee); a sampler that groups or orders examples would change what the "
        "accountant counts, and would be ignored. Leave it 'random'.")),
    "length_column_name": _irrelevant("read only by train_sampling_strategy='group_by_length', which is refused"),
    "dataloader_drop_last": _refused(lambda v: not v, (
        "training batches are Poisson samples: there is no last, incomplete batch to drop (the flag would be "
        "ignored), and on evaluation it would silently leave examples out. Leave it False.")),
    "data_seed": _refused(lambda v: v is None, (
        "training batches are drawn from the run's secret randomness, not from a seed; data_seed would seed "
        "nothing. For reproducible batches and noise in tests, set noise_seed (NOT private).")),
    "dataloader_in_order": _refused(bool, (
        "out-of-order loading lets micro-batches of different Poisson-sampled logical batches overtake each other, "
        "so one noisy step would sum parts of two samples. Leave it True.")),
    "dataloader_num_workers": _honoured("passed to DPTrainer's training DataLoader and the Trainer's eval ones"),
    "dataloader_pin_memory": _honoured("passed to DPTrainer's training DataLoader and the Trainer's eval ones"),
    "dataloader_persistent_workers": _honoured("passed to DPTrainer's training DataLoader and the Trainer's eval ones"),
    "dataloader_prefetch_factor": _honoured("passed to DPTrainer's training DataLoader and the Trainer's eval ones"),
    "dataloader_multiprocessing_context": _honoured("passed to DPTrainer's training DataLoader and the eval ones"),
    "remove_unused_columns": _honoured("DPTrainer removes the same columns from the training set"),
    "label_names": _refused(lambda v: v in (None, ["labels"]), (
        "DPTrainer's per-example loss reads the batch's `labels`; other label keys would be ignored in training. "
        "Rename the column to `labels` (`dataset.rename_column(old, 'labels')`) and leave label_names unset.")),
    "accelerator_config": _refused(lambda v: not _accelerator_option(v, "split_batches"), (
        "split_batches=True makes per_device_train_batch_size the global batch, but DPTrainer's training batches "
        "are not prepared by accelerate: the batch and the sample rate would silently differ from what you set. "
        "Set per_device_train_batch_size per process (the logical batch multiplies it by the processes).")),
    "ignore_data_skip": _refused(lambda v: not v, (
        "ignore_data_skip=True would replay the epoch's batch draws on resume while the accountant counts fresh "
        "ones (and mix up the phases' sample rates). Leave it False: the skipped batches are index draws only.")),
    # ---- several processes -------------------------------------------------------------------------------------
    "local_rank": _honoured(_TRAINER),
    "ddp_backend": _honoured(_TRAINER),
    "ddp_timeout": _honoured(_TRAINER),
    "ddp_broadcast_buffers": _honoured(_TRAINER),
    "ddp_find_unused_parameters": _irrelevant(_NO_DDP_SYNC),
    "ddp_bucket_cap_mb": _irrelevant(_NO_DDP_SYNC),
    "ddp_static_graph": _irrelevant(_NO_DDP_SYNC),
    "parallelism_config": _refused(lambda v: v is None, "tensor, context or sharded parallelism split one "
                                   "example's computation across processes. " + _SPLIT_MODEL),
    "fsdp": _honoured("DPTrainer shards the model with FSDP2 itself (training.sharding): each rank clips its own "
                      "examples, clipped sums are reduce-scattered, noise is added once per coordinate; accelerate's "
                      "FSDP plugin is never built. What cannot run sharded is refused there"),
    "fsdp_config": _honoured("version 2, reshard_after_forward and transformer_layer_cls_to_wrap; every other key "
                             "is refused (training.sharding.FSDP_CONFIG)"),
    "deepspeed": _refused(lambda v: v is None, DEEPSPEED_REASON),
    # ---- logging and trackers ----------------------------------------------------------------------------------
    "logging_strategy": _honoured(_LOGS),
    "logging_steps": _honoured(_LOGS),
    "logging_first_step": _honoured(_LOGS),
    "log_on_each_node": _honoured(_LOGS),
    "logging_nan_inf_filter": _honoured(_LOGS),
    "include_num_input_tokens_seen": _refused(lambda v: v in (False, "no"), "it counts the tokens of every "
                                              "Poisson-sampled batch (the secret batch sizes) into every log, "
                                              "trainer_state.json and the metrics files, outside the guarantee. Set "
                                              "include_num_input_tokens_seen='no' (the default)"),
    "log_level": _honoured(_LOGS),
    "log_level_replica": _honoured(_LOGS),
    "disable_tqdm": _honoured(_LOGS),
    "report_to": _honoured(_LOGS),
    "run_name": _honoured(_LOGS),
    "project": _honoured(_LOGS),
    "trackio_space_id": _honoured(_LOGS),
    "trackio_bucket_id": _honoured(_LOGS),
    "trackio_static_space_id": _honoured(_LOGS),
    "skip_memory_metrics": _honoured(_TRAINER),
    "debug": _honoured(_TRAINER),
    # ---- evaluation ----------------------------------------------------------------------------------------------
    "eval_strategy": _honoured(_EVAL),
    "eval_steps": _honoured(_EVAL),
    "eval_delay": _honoured(_EVAL),
    "per_device_eval_batch_size": _honoured(_EVAL),
    "prediction_loss_only": _honoured(_EVAL),
    "eval_on_start": _honoured(_EVAL),
    "eval_do_concat_batches": _honoured(_EVAL),
    "eval_use_gather_object": _honoured(_EVAL),
    "eval_accumulation_steps": _honoured(_EVAL),
    "include_for_metrics": _honoured(_EVAL),
    "batch_eval_metrics": _honoured(_EVAL),
    "load_best_model_at_end": _honoured("the best checkpoint by an eval metric (each is a DP iterate; choose on "
                                        "public or held-out data)"),
    "metric_for_best_model": _honoured("see load_best_model_at_end"),
    "greater_is_better": _honoured("see load_best_model_at_end"),
    # ---- checkpoints and resuming --------------------------------------------------------------------------------
    "save_strategy": _honoured(_SAVE),
    "save_steps": _honoured(_SAVE),
    "save_total_limit": _honoured(_SAVE),
    "save_only_model": _honoured(_SAVE),
    "save_on_each_node": _honoured(_SAVE),
    "enable_jit_checkpoint": _honoured(_SAVE),
    "restore_callback_states_from_checkpoint": _honoured(_TRAINER),
    "seed": _honoured("model initialisation, dropout and evaluation; never the DP noise or the batches (those come "
                      "from a fresh secret, or from noise_seed)"),
    "full_determinism": _honoured("the Trainer's determinism; DP noise and batches still come from the run's secret"),
    # ---- the Hub -------------------------------------------------------------------------------------------------
    "push_to_hub": _honoured(_HUB),
    "hub_model_id": _honoured(_HUB),
    "hub_strategy": _honoured(_HUB + "; 'checkpoint' and 'all_checkpoints' are refused (config.check_hub_strategy)"),
    "hub_private_repo": _honoured(_HUB),
    "hub_always_push": _honoured(_HUB),
    "hub_revision": _honoured(_HUB),
    "hub_token": _refused(lambda v: not v, (
        "hub_token would be pickled into training_args.bin, which is saved with every checkpoint. Log in with "
        "`hf auth login` or set HF_TOKEN instead.")),
    # ---- for scripts -------------------------------------------------------------------------------------------
    "do_train": _irrelevant(_SCRIPTS),
    "do_eval": _irrelevant(_SCRIPTS),
    "do_predict": _irrelevant(_SCRIPTS),
    "resume_from_checkpoint": _irrelevant(_SCRIPTS + " (pass it to train())"),
}


def check_refused_fields(args) -> None:
    """Raise `DPConfigError` for the first TrainingArguments field set to a value DP-SGD refuses (see `FIELDS`)."""
    for name, entry in FIELDS.items():
        if entry.decision == "refused" and hasattr(args, name) and not entry.allowed(getattr(args, name)):
            value = _value(getattr(args, name))
            shown = ("<set>" if name == "hub_token" else repr(value)  # never print a token
                     if isinstance(value, (str, int, float, list, dict)) else f"<{type(value).__name__}>")
            raise DPConfigError(f"DPTrainingArguments: {name}={shown} is refused under DP-SGD: {entry.why}")


def train_dataloader_options(args) -> dict:
    """The DataLoader options of `args` that DPTrainer's training DataLoader takes (its batches come from the
    Poisson sampler)."""
    return dict(num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
                persistent_workers=args.dataloader_persistent_workers, prefetch_factor=args.dataloader_prefetch_factor,
                multiprocessing_context=args.dataloader_multiprocessing_context)


def _accelerator_option(config, name: str):
    if config is None or isinstance(config, str):  # a JSON file path: read by the Trainer later
        return None
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)
