"""What `DPTrainer` adds to the Trainer's saving, loading and pushing (a mixin placed before `Trainer`).

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

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy, rotate_checkpoints
from transformers.utils import PushInProgress, logging

from ...errors import ArgumentTypeError
from ..arguments import check_hub_strategy
from .output_dir import ARGS_FILE, STAGING_DIR, check_writable, fsync_folder
from .weights import load_checkpoint_weights

logger = logging.get_logger(__name__)


class DPSavingMixin:
    """Saving, loading and Hub pushes of `DPTrainer` (expects `self.ledger` and the Trainer's attributes)."""

    _spent_dir: str | None = None  # where privacy_spent.json is kept up to date (when a resume can need it)
    sharded = False  # FSDP2: saves and loads are collectives, written by rank 0 (`training.checkpoints.sharded`)

    def __init__(self, *args, **kwargs):
        """output_dir is checked writable now, not at the first save after training; the Trainer's `__init__`
        makes it, but a refusal before the work starts must leave nothing behind: made when training starts."""
        training_args = kwargs["args"]
        made = _missing_folders(training_args.output_dir) if training_args.should_save else []
        if training_args.should_save:
            check_writable(training_args.output_dir)
        super().__init__(*args, **kwargs)
        for folder in made:  # deepest first; only those still empty
            with contextlib.suppress(OSError):
                os.rmdir(folder)

    # ---- privacy spent: recorded after every step for a resume to charge ------------------------------
    def _start_spent_record(self, resuming: bool) -> None:
        """The work starts: make output_dir, and keep privacy_spent.json there if checkpoints may be resumed."""
        args = self.args
        if args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)
        keep = args.should_save and (resuming or args.save_strategy != SaveStrategy.NO)
        self._spent_dir = args.output_dir if keep else None

    def _write_spent(self, ledger=None) -> None:
        """Record the ledger's position (after every noisy step: before anything derived from it is logged)."""
        ledger = self.ledger if ledger is None else ledger
        if self._spent_dir is not None and ledger is not None:
            from .resume import write_spent

            write_spent(self._spent_dir, ledger)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # transformers' own loader misses renamed keys (ViT) with a mere warning: restore exactly, or refuse.
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_weights(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_best_model()
        logger.info(f"Loading best model from {self.state.best_model_checkpoint} (score: {self.state.best_metric}).")
        self._load_weights(self.state.best_model_checkpoint)

    def _load_weights(self, checkpoint: str) -> None:
        if self.sharded:
            from .sharded import load_sharded_weights

            return load_sharded_weights(self.model, checkpoint)
        load_checkpoint_weights(self.model, checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.sharded:  # the Trainer's optimizer.pt of a sharded model would hold rank 0's shards only
            return super()._save_optimizer_and_scheduler(output_dir)
        from .sharded import save_sharded_optimizer

        save_sharded_optimizer(self, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.sharded or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        from .sharded import load_sharded_optimizer

        load_sharded_optimizer(self, checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """As the Trainer's; a sharded model is gathered (every rank must call it) and written by rank 0."""
        if self.sharded:
            from .sharded import save_sharded_model

            save_sharded_model(self, output_dir or self.args.output_dir)
            if self.args.push_to_hub and not _internal_call:  # as the Trainer's save_model
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        else:
            super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:  # peft records the base model's local path; it must not be pushed
            from ...hub.public_names import public_adapter_config

            public_adapter_config(output_dir or self.args.output_dir)
        self._save_privacy_record(output_dir or self.args.output_dir)

    # ---- checkpoints: whole or absent ------------------------------------------------------------------
    _staging_checkpoint = False  # True while the Trainer writes a checkpoint (into the staging folder)

    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, STAGING_DIR) if self._staging_checkpoint else run_dir

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written into `<run_dir>/.checkpoint-staging/checkpoint-N`; then the arguments
        (JSON) and the ledger, last; every file flushed to disk; then renamed to `<run_dir>/checkpoint-N` and the
        old checkpoints rotated out. A kill at any point leaves the previous checkpoints as they were."""
        self._staging_checkpoint = False
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging, final = os.path.join(run_dir, STAGING_DIR, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.exists(staging):  # left by an interrupted save
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        self._staging_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)  # rotates nothing: the staging folder holds this checkpoint only
        finally:
            self._staging_checkpoint = False
        self.accelerator.wait_for_everyone()  # every process has written its files (RNG states)
        if self.args.should_save:
            self._commit_checkpoint(staging, final, run_dir)
        self.accelerator.wait_for_everyone()

    def _commit_checkpoint(self, staging: str, final: str, run_dir: str) -> None:
        if self.state.best_model_checkpoint and os.path.dirname(self.state.best_model_checkpoint) == os.path.dirname(
                staging):  # the Trainer found the best checkpoint in the staging folder: name its final place
            self.state.best_model_checkpoint = final
            self.state.save_to_json(os.path.join(staging, "trainer_state.json"))
        with open(os.path.join(staging, ARGS_FILE), "w") as f:  # what resume compares its arguments with
            f.write(self.args.to_json_string())
        fsync_folder(staging, files=True)
        if self.ledger is not None:
            self.ledger.save(staging)  # last: a checkpoint with a readable ledger is complete
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
        if self.args.push_to_hub:  # held back while staging: the push needs the ledger
            self._push_from_checkpoint(final)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def save_metrics(self, split, metrics, combined=True) -> None:
        """As the Trainer's, but without the `train_*` metrics (computed on the private data outside DP-SGD) and as
        valid JSON (ε = ∞ as null): these files may be pushed."""
        if self.is_world_process_zero():
            from ...hub.push import save_public_metrics

            os.makedirs(self.args.output_dir, exist_ok=True)  # not made by __init__ (refusals write nothing)
            save_public_metrics(self.args.output_dir, split, metrics, combined)

    # ---- Hub: every push goes through hf_dp_repr.hub's allow-list -----------------------------------------------
    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Check login and write access first (`hf_dp_repr.hub.check_hub_access`), then create the repository."""
        if self.is_world_process_zero():
            from ...hub.push import check_hub_access

            check_hub_access(self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir)), token)
        super().init_hf_repo(token=token, private=private)

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, private: bool | None = None, **kwargs):
        """Save, then upload the run through `hf_dp_repr.hub.push_dp_model`: an allow-list of files (weights,
        metrics, representation laws, privacy ledger, the DP model card), never checkpoints or training_args.bin.
        `hub_model_id=` names the repository (default: args.hub_model_id, else output_dir's name); the Trainer's card
        keywords (license, tags, language, model_name, finetuned_from, dataset) go into the DP card; others are
        refused (`ModelCardInfo.with_trainer_card_args`)."""
        from ...hub.card import ModelCardInfo
        from ...hub.push import push_dp_model

        repo_id = kwargs.pop("hub_model_id", None) or self.hub_model_id or self.args.hub_model_id
        if kwargs:  # the Trainer's card keywords (license, tags, ...) go into the DP card; the others are refused
            self.model_card_info = ModelCardInfo.from_value(self.model_card_info).with_trainer_card_args(**kwargs)
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        self.save_model(_internal_call=True)
        self._finish_current_push()
        return push_dp_model(self, repo_id, commit_message=commit_message, revision=revision or self.args.hub_revision,
                             token=token, private=private, run_as_future=not blocking)

    def create_model_card(self, *args, **kwargs):
        """The DP model card (ε, δ, σ, scope, ...), never the Trainer's generic one, which would overwrite it; the
        Trainer's card keywords (license, tags, language, ...) go into it (`ModelCardInfo.with_trainer_card_args`)."""
        if self.ledger is None:
            return super().create_model_card(*args, **kwargs)
        from ...hub.card import ModelCardInfo, write_model_card

        if args:
            raise ArgumentTypeError("DPTrainer.create_model_card: pass its arguments by name (license=..., tags=...).")
        if kwargs:
            self.model_card_info = ModelCardInfo.from_value(self.model_card_info).with_trainer_card_args(**kwargs)
        if self.is_world_process_zero():
            write_model_card(self, self.args.output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """A push during training (hub_strategy 'every_save'): the checkpoint's allow-listed files (weights, ledger,
        DP card) are copied to output_dir and pushed from there through the allow-list, never the checkpoint's
        trainer_state.json, optimizer / RNG state or training_args.bin (the Trainer's own push sends them)."""
        if self._staging_checkpoint or not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        check_hub_strategy(self.args)
        if self.push_in_progress is not None and not self.push_in_progress.is_done():
            if not self.args.hub_always_push:
                return
            self.push_in_progress.wait_until_done()  # it may still read the files about to be overwritten below
        from ...hub.push import files_to_push, upload_run

        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        out = self.args.output_dir
        for name in files_to_push(checkpoint_folder):
            shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(out, name))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        job = upload_run(out, self.hub_model_id, commit_message=f"Training in progress, step {self.state.global_step}",
                         revision=self.args.hub_revision, run_as_future=True)
        if self.push_in_progress is None or self.push_in_progress.is_done():
            self.push_in_progress = PushInProgress([job])
        else:
            self.push_in_progress.jobs.append(job)

    def save_merged_model(self, output_dir: str | None = None) -> None:
        """For a LoRA (PEFT) model: save the base weights with the adapters merged in, as a plain HF model
        (`save_model` saves the adapters alone), plus the privacy ledger and model card. The merge happens on a
        copy (`lora.merged_copy`), cleared of the DP bookkeeping on its parameters; a model without adapters is saved
        as it is."""
        from ...privacy.attributes import clear_dp_attributes
        from ...scope.lora import is_peft_model, merged_copy

        if self.sharded:
            from ...errors import UnsupportedError

            raise UnsupportedError("DPTrainer.save_merged_model: not for a sharded (fsdp) run; save_model() saves the "
                                   "adapters, which peft merges later (PeftModel.from_pretrained(base, folder)"
                                   ".merge_and_unload()), with the same ledger and card.")
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            model = self.model
            if is_peft_model(model):
                model = merged_copy(model)
                clear_dp_attributes(model.parameters())  # bookkeeping the trainer attached to the live parameters
                for p in model.parameters():
                    p.requires_grad_(True)
            model.save_pretrained(output_dir, safe_serialization=True)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        self._save_privacy_record(output_dir)

    def _save_privacy_record(self, output_dir: str) -> None:
        """The ledger and the model card that states the guarantee go next to every saved model (in a checkpoint,
        the ledger is written last, by `_commit_checkpoint`)."""
        if self.ledger is None or not self.args.should_save:
            return
        if not self._staging_checkpoint:
            self.ledger.save(output_dir)
        from ...hub.card import write_model_card

        write_model_card(self, output_dir)
        if getattr(self, "continual_record", None) is not None:  # public → private: the switch and tr(H) record
            from ..continual.public_phase import save_record

            save_record(self.continual_record, output_dir)


def _missing_folders(path: str) -> list[str]:
    """`path` and its parents that do not exist, deepest first."""
    missing, folder = [], os.path.abspath(path)
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing
