"""Every private member of `transformers.Trainer` (and of Opacus) that hf-dp-repr overrides or relies on, in one place.

A private member may change in any release, without a deprecation. tests/test_hf_compat.py checks each entry here
against the installed versions: the parameters, and that the Trainer still calls it (or still does what we rely
on) where we rely on it; a failure names the installed version and `TESTED_TRANSFORMERS`, the range the suite
ran on (setup.cfg pins it). The public overrides (`get_train_dataloader`, `create_optimizer`, `create_scheduler`,
`training_step`, `train`, `log`, `call_model_init`, `get_eval_dataloader`, `prediction_step`, `save_model`,
`save_metrics`, `init_hf_repo`, `push_to_hub`, `create_model_card`, `hyperparameter_search`) are documented API.

Example:
    >>> from hf_dp_repr.training.hf_compat import PRIVATE_OVERRIDES
    >>> sorted(m.name for m in PRIVATE_OVERRIDES if m.owner == "DPTrainer")
    ['_get_output_dir', '_load_best_model', '_load_from_checkpoint', '_load_optimizer_and_scheduler',
     '_push_from_checkpoint', '_save_checkpoint', '_save_optimizer_and_scheduler']
"""

from __future__ import annotations

from dataclasses import dataclass

TESTED_TRANSFORMERS = "transformers>=5.24,<5.25"
TESTED_OPACUS = "opacus>=1.6,<1.7"


@dataclass(frozen=True)
class PrivateMember:
    """A private Trainer method: its parameters, the Trainer method whose source calls it (`caller`, with the
    `call` text), and why we override or use it. `owner`: the class that overrides it (None: used only)."""

    name: str
    params: tuple[str, ...]
    caller: str
    call: str
    why: str
    owner: str | None = None


PRIVATE_OVERRIDES = (
    PrivateMember("_load_from_checkpoint", ("self", "resume_from_checkpoint", "model"), "train",
                  "self._load_from_checkpoint(resume_from_checkpoint)",
                  "restore a checkpoint's weights exactly or refuse (transformers warns on renamed keys); runs "
                  "before the loop, after model_init; checkpoints.resume calls it for a finished run", "DPTrainer"),
    PrivateMember("_load_best_model", ("self",), "_finalize_training", "self._load_best_model()",
                  "the same exact load, before on_train_end (a callback must not see a lax load)", "DPTrainer"),
    PrivateMember("_save_checkpoint", ("self", "model", "trial"), "_maybe_log_save_evaluate",
                  "self._save_checkpoint(model, trial)",
                  "a checkpoint whole or absent: staged, ledger last, flushed, renamed, then rotated (on_save "
                  "fires after the Trainer rotated)", "DPTrainer"),
    PrivateMember("_get_output_dir", ("self", "trial"), "_save_checkpoint", "self._get_output_dir(trial=trial)",
                  "redirect the Trainer's checkpoint into the staging folder", "DPTrainer"),
    PrivateMember("_push_from_checkpoint", ("self", "checkpoint_folder"), "_save_checkpoint",
                  "self._push_from_checkpoint(output_dir)",
                  "hub_strategy='every_save' pushes through the allow-list, never the Trainer's push", "DPTrainer"),
    PrivateMember("_save_optimizer_and_scheduler", ("self", "output_dir"), "_save_checkpoint",
                  "self._save_optimizer_and_scheduler(output_dir)",
                  "sharded (fsdp): the full optimizer state gathered and written by rank 0 (the Trainer's would "
                  "hold rank 0's shards only)", "DPTrainer"),
    PrivateMember("_load_optimizer_and_scheduler", ("self", "checkpoint"), "_prepare_for_training",
                  "self._load_optimizer_and_scheduler(resume_from_checkpoint)",
                  "sharded (fsdp): the full optimizer state read by rank 0 and broadcast into the shards", "DPTrainer"),
    PrivateMember("_set_signature_columns_if_needed", ("self",), "_remove_unused_columns",
                  "self._set_signature_columns_if_needed()",
                  "audit.dirac: keep the canary column the model's forward does not take", "DiracCanaryTrainer"),
    PrivateMember("_prepare_inputs", ("self", "inputs"), "prediction_step", "self._prepare_inputs(inputs)",
                  "audit.dirac: the canary rows' inputs, in training (DPTrainer.training_step) and evaluation",
                  "DiracCanaryTrainer"),
)

PRIVATE_USED = (
    PrivateMember("_prepare_inputs", ("self", "inputs"), "training_step", "self._prepare_inputs(inputs)",
                  "DPTrainer.training_step and the start-of-training probe move a batch as the Trainer does"),
    PrivateMember("_remove_unused_columns", ("self", "dataset", "description"), "_get_dataloader",
                  "self._remove_unused_columns(",
                  "the training set (and cached evaluation features) without the columns forward does not take"),
    PrivateMember("_get_collator_with_removed_columns", ("self", "data_collator", "description"), "_get_dataloader",
                  "self._get_collator_with_removed_columns(", "the same for an iterable dataset"),
    PrivateMember("_finish_current_push", ("self",), "push_to_hub", "self._finish_current_push()",
                  "DPTrainer.push_to_hub waits for a running push as the Trainer's does"),
    PrivateMember("_hp_search_setup", ("self", "trial"), "train", "self._hp_search_setup(trial)",
                  "tuning.search sets each trial's arguments from hp_space (called here), before the training "
                  "dataloader gives the trial's model its head_init and scope"),
    PrivateMember("_save", ("self", "output_dir", "state_dict"), "save_model", "self._save(output_dir",
                  "sharded (fsdp): rank 0 writes the gathered full state dict as the Trainer writes a model"),
    PrivateMember("_defer_fsdp_gradient_reduction", ("self",), "_run_epoch",
                  "sync_context = self._defer_fsdp_gradient_reduction",
                  "sharded (fsdp): the Trainer enters it between micro-batches of a model marked sharded at load "
                  "time; it reads config.distributed_config, which training.sharding sets (no gradient is reduced: "
                  "DP-SGD forms none)"),
    PrivateMember("_get_num_items_in_batch", ("self", "batch_samples", "device"), "get_batch_samples",
                  "self._get_num_items_in_batch(batch_samples, device)",
                  "counts nothing when model_accepts_loss_kwargs is False and no compute_loss_func is set (DPTrainer "
                  "sets the first and refuses the second): DP-SGD sums per-example losses itself"),
)

# Trainer attributes whose role we rely on: (name, why). Each is assigned in Trainer's source.
ATTRIBUTES = (
    ("model_accepts_loss_kwargs", "False: no item count, no num_items_in_batch passed to the model"),
    ("hp_search_backend", "set during a search: a trial's head_init waits for its arguments"),
    ("push_in_progress", "the running Hub push, waited for before copying files"),
    ("current_gradient_accumulation_steps", "the training loss reported per micro-batch"),
    ("_signature_columns", "audit.dirac appends the canary column"),
    ("is_distributed_loading_by_transformers", "read from the model's mark (training.sharding sets it on a model it "
     "shards): no DDP wrap, no second sharding, the sharded parameters given to the optimizer, every rank in saves"),
)

# Arguments hidden from `Trainer.__init__` alone for a sharded run (training.sharding.trainer_init): (field, the text of
# the read in __init__, why). tests/test_sharding.py checks each is read there and by no other Trainer method.
HIDDEN_READS = (
    ("fsdp", "if args.fsdp:", "else 'Using fsdp only works in distributed training' (a 1-process test group) and the "
     "fsdp/deepspeed clash, which DPTrainer refuses itself"),
    ("save_only_model", "and not args.save_only_model", "else 'Resuming is not supported for models sharded at load "
     "time': DPTrainer checkpoints and restores a sharded run's optimizer itself"),
)

# The order of the Trainer's loop that DPTrainer relies on: in `method`'s source, each text appears after the one
# before it.
ORDER = (
    ("train", ("self.call_model_init(trial)", "self._hp_search_setup(trial)", "self._load_from_checkpoint(",
               "inner_training_loop(")),
    ("_inner_training_loop", ("self.get_train_dataloader()", "self._prepare_for_training(")),
    ("_prepare_for_training", ("self.create_optimizer()", "self.create_scheduler(")),
    # ema_decay (training.averaging): the average takes the step's update before anything is saved or evaluated,
    # and a checkpoint's model file is written by save_model (the average, with the raw iterate next to it).
    ("_run_epoch", ("self.optimizer.step()", "self.callback_handler.on_step_end(", "self._maybe_log_save_evaluate(")),
    ("_save_checkpoint", ("self._get_output_dir(trial=trial)", "self.save_model(output_dir, _internal_call=True)")),
)

# TRL (the `trl` extra, hf_dp_repr.trl): (class in trl, member, the text of its use in `where`'s source, why),
# checked by tests/test_trl_sft.py. Strings only: the training stage never imports trl.
TESTED_TRL = "trl==1.16.0"
TRL_PRIVATE = (
    ("_BaseTrainer", "_send_telemetry", "__init__", "self._send_telemetry()",
     "DPMechanism overrides it with a no-op: nothing about a private run leaves the process"),
    ("SFTTrainer", "_save_checkpoint", "_save_checkpoint", "self.create_model_card(model_name=model_name)",
     "DPMechanism keeps TRL's checkpoint card call from replacing the DP card's model_card_info"),
    ("SFTTrainer", "_metrics", "log", "self._metrics[mode]",
     "DPMechanism.log clears the training metrics (of private examples) before SFTTrainer.log reads them"),
    ("DPOTrainer", "_metrics", "log", "self._metrics[mode]",
     "DPMechanism.log clears the training metrics (of private pairs) before DPOTrainer.log reads them"),
)

# Opacus' private helper the "ddp" reduction draws its noise with: (module, name, parameters).
# datasets: (private attribute of `datasets.Dataset`, why); tests/test_hf_compat.py checks it is still set and still
# changes with the rows.
DATASETS_PRIVATE = (("_fingerprint", "the rows' identity, updated by every transform: the recipes' check_source of the "
                     "training split, hp_search.tuning_data, start_checks' key of the probe's result"),)
OPACUS_PRIVATE = (("opacus.optimizers.optimizer", "_generate_noise", ("std", "reference", "generator", "secure_mode")),)
