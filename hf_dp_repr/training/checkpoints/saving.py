"""What `DPTrainer` adds to the Trainer's saving, loading and pushing (its overrides call these helpers).

- Saving: the privacy ledger and the DP model card go next to every saved model; metrics files drop `train_*`.
  A checkpoint is written whole or not at all: the Trainer writes it into a staging folder, its ledger is written
  last (with the run's arguments as JSON before it), every file is flushed to disk and the folder is renamed into
  place (`checkpoint-N` exists only complete); older checkpoints are rotated out only after that.
- Loading: checkpoints are restored exactly (`checkpoints.weights`), or refused; never a silent partial load.
- Pushing: every push goes through `hf_dp_repr.hub`'s allow-list; never checkpoints or training_args.bin.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from transformers.trainer_utils import HubStrategy, SaveStrategy, rotate_checkpoints
from transformers.utils import PushInProgress, logging

from ...errors import ArgumentTypeError
from ..arguments import check_hub_strategy
from .output_dir import ARGS_FILE, fsync_folder
from .weights import load_checkpoint_weights

logger = logging.get_logger(__name__)


def missing_folders(path: str) -> list[str]:
    """`path` and its parents that do not exist, deepest first (DPTrainer's `__init__` removes those the Trainer's
    made: a refusal before the work starts must leave nothing behind; they are made when training starts)."""
    missing, folder = [], os.path.abspath(path)
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


# ---- privacy spent: recorded after every step for a resume to charge ------------------------------
def start_spent_record(trainer, resuming: bool) -> None:
    """The work starts: make output_dir, and keep privacy_spent.json there if checkpoints may be resumed."""
    args = trainer.args
    if args.should_save:
        os.makedirs(args.output_dir, exist_ok=True)
    keep = args.should_save and (resuming or args.save_strategy != SaveStrategy.NO)
    trainer._spent_dir = args.output_dir if keep else None


def record_spent(trainer, ledger=None) -> None:
    """Record the ledger's position (after every noisy step: before anything derived from it is logged)."""
    ledger = trainer.ledger if ledger is None else ledger
    if trainer._spent_dir is not None and ledger is not None:
        from .resume import write_spent

        write_spent(trainer._spent_dir, ledger)


def load_weights(trainer, checkpoint: str) -> None:
    """A checkpoint's weights restored exactly, or refused (transformers' own loader misses renamed keys, e.g. ViT,
    with a mere warning)."""
    if trainer.sharded:
        from .sharded import load_sharded_weights

        return load_sharded_weights(trainer.model, checkpoint)
    load_checkpoint_weights(trainer.model, checkpoint)


# ---- checkpoints: whole or absent ------------------------------------------------------------------
def commit_checkpoint(trainer, staging: str, final: str, run_dir: str) -> None:
    """The staged checkpoint made complete (arguments as JSON, flushed, ledger last) and renamed into place; the old
    checkpoints rotated out after that."""
    state, args = trainer.state, trainer.args
    if state.best_model_checkpoint and os.path.dirname(state.best_model_checkpoint) == os.path.dirname(
            staging):  # the Trainer found the best checkpoint in the staging folder: name its final place
        state.best_model_checkpoint = final
        state.save_to_json(os.path.join(staging, "trainer_state.json"))
    with open(os.path.join(staging, ARGS_FILE), "w") as f:  # what resume compares its arguments with
        f.write(args.to_json_string())
    fsync_folder(staging, files=True)
    if trainer.ledger is not None:
        trainer.ledger.save(staging)  # last: a checkpoint with a readable ledger is complete
    fsync_folder(staging)
    old = None
    if os.path.exists(final):  # written before by another run (overwrite_output_dir): replaced whole
        old = os.path.join(os.path.dirname(staging), f"{os.path.basename(final)}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staging, final)
    fsync_folder(run_dir)
    if old is not None:
        shutil.rmtree(old)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(staging))  # only if empty
    if args.push_to_hub:  # held back while staging: the push needs the ledger
        trainer._push_from_checkpoint(final)
    rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                       best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)


def save_privacy_record(trainer, output_dir: str) -> None:
    """The ledger and the model card that states the guarantee go next to every saved model (in a checkpoint,
    the ledger is written last, by `commit_checkpoint`)."""
    if trainer.ledger is None or not trainer.args.should_save:
        return
    if not trainer._staging_checkpoint:
        trainer.ledger.save(output_dir)
    from ...hub.card import write_model_card

    write_model_card(trainer, output_dir)
    if getattr(trainer, "continual_record", None) is not None:  # public → private: the switch and tr(H) record
        from ..continual.public_phase import save_record

        save_record(trainer.continual_record, output_dir)


def save_merged(trainer, output_dir: str | None = None) -> None:
    """`DPTrainer.save_merged_model`: the merge happens on a copy (`lora.merged_copy`), cleared of the DP
    bookkeeping on its parameters; a model without adapters is saved as it is."""
    from ...privacy.attributes import clear_dp_attributes
    from ...scope.lora import is_peft_model, merged_copy

    if trainer.sharded:
        from ...errors import UnsupportedError

        raise UnsupportedError("DPTrainer.save_merged_model: not for a sharded (fsdp) run; save_model() saves the "
                               "adapters, which peft merges later (PeftModel.from_pretrained(base, folder)"
                               ".merge_and_unload()), with the same ledger and card.")
    output_dir = output_dir or trainer.args.output_dir
    if trainer.args.should_save:
        os.makedirs(output_dir, exist_ok=True)
        model = trainer.model
        if is_peft_model(model):
            model = merged_copy(model)
            clear_dp_attributes(model.parameters())  # bookkeeping the trainer attached to the live parameters
            for p in model.parameters():
                p.requires_grad_(True)
        model.save_pretrained(output_dir, safe_serialization=True)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
    save_privacy_record(trainer, output_dir)


# ---- Hub: every push goes through hf_dp_repr.hub's allow-list -----------------------------------------------
def take_card_args(trainer, args: tuple, kwargs: dict) -> None:
    """The Trainer's card keywords (license, tags, language, ...) go into the DP card; others are refused
    (`ModelCardInfo.with_trainer_card_args`)."""
    from ...hub.card import ModelCardInfo

    if args:
        raise ArgumentTypeError("DPTrainer.create_model_card: pass its arguments by name (license=..., tags=...).")
    if kwargs:
        trainer.model_card_info = ModelCardInfo.from_value(trainer.model_card_info).with_trainer_card_args(**kwargs)


def push_checkpoint(trainer, checkpoint_folder: str) -> None:
    """A push during training (hub_strategy 'every_save'): the checkpoint's allow-listed files (weights, ledger,
    DP card) are copied to output_dir and pushed from there through the allow-list, never the checkpoint's
    trainer_state.json, optimizer / RNG state or training_args.bin (the Trainer's own push sends them)."""
    args = trainer.args
    if trainer._staging_checkpoint or not trainer.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
        return
    check_hub_strategy(args)
    if trainer.push_in_progress is not None and not trainer.push_in_progress.is_done():
        if not args.hub_always_push:
            return
        trainer.push_in_progress.wait_until_done()  # it may still read the files about to be overwritten below
    from ...hub.push import files_to_push, upload_run

    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    out = args.output_dir
    for name in files_to_push(checkpoint_folder):
        shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(out, name))
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(out)
    step = trainer.state.global_step
    job = upload_run(out, trainer.hub_model_id, commit_message=f"Training in progress, step {step}",
                     revision=args.hub_revision, run_as_future=True)
    if trainer.push_in_progress is None or trainer.push_in_progress.is_done():
        trainer.push_in_progress = PushInProgress([job])
    else:
        trainer.push_in_progress.jobs.append(job)
