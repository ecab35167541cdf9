"""What `DPTrainer` adds to the Trainer's saving, loading and pushing (a mixin placed before `Trainer`).

- Saving: the privacy ledger and the DP model card go next to every saved model; metrics files drop `train_*`.
- Loading: checkpoints are restored exactly (`hf_dp_repr.checkpoint`), or refused; never a silent partial load.
- Pushing: every push goes through `hf_dp_repr.hub`'s allow-list; never checkpoints or training_args.bin.
"""

from __future__ import annotations

import os
import shutil

from transformers.trainer_utils import HubStrategy
from transformers.utils import PushInProgress, logging

from .checkpoint import load_checkpoint_weights
from .config import check_hub_strategy

logger = logging.get_logger(__name__)


class DPSavingMixin:
    """Saving, loading and Hub pushes of `DPTrainer` (expects `self.ledger` and the Trainer's attributes)."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # transformers' own loader misses renamed keys (ViT) with a mere warning: restore exactly, or refuse.
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_checkpoint_weights(self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_best_model()
        logger.info(f"Loading best model from {self.state.best_model_checkpoint} (score: {self.state.best_metric}).")
        load_checkpoint_weights(self.model, self.state.best_model_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:  # peft records the base model's local path; it must not be pushed
            from .public_names import public_adapter_config

            public_adapter_config(output_dir or self.args.output_dir)
        self._save_privacy_record(output_dir or self.args.output_dir)

    def save_metrics(self, split, metrics, combined=True) -> None:
        """As the Trainer's, but without the `train_*` metrics (computed on the private data outside DP-SGD) and as
        valid JSON (ε = ∞ as null): these files may be pushed."""
        if self.is_world_process_zero():
            from .hub import save_public_metrics

            save_public_metrics(self.args.output_dir, split, metrics, combined)

    # ---- Hub: every push goes through hf_dp_repr.hub's allow-list -----------------------------------------------
    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Check login and write access first (`hf_dp_repr.hub.check_hub_access`), then create the repository."""
        if self.is_world_process_zero():
            from .hub import check_hub_access

            check_hub_access(self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir)), token)
        super().init_hf_repo(token=token, private=private)

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, private: bool | None = None, **kwargs):
        """Save, then upload the run through `hf_dp_repr.hub.push_dp_model`: an allow-list of files (weights,
        metrics, representation laws, privacy ledger, the DP model card), never checkpoints or training_args.bin.
        `hub_model_id=` names the repository (default: args.hub_model_id, else output_dir's name); the Trainer's card
        keywords (license, tags, language, model_name, finetuned_from, dataset) go into the DP card; others are
        refused (`ModelCardInfo.with_trainer_card_args`)."""
        from .hub import push_dp_model
        from .model_card import ModelCardInfo

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
        from .model_card import ModelCardInfo, write_model_card

        if args:
            raise TypeError("DPTrainer.create_model_card: pass its arguments by name (license=..., tags=...).")
        if kwargs:
            self.model_card_info = ModelCardInfo.from_value(self.model_card_info).with_trainer_card_args(**kwargs)
        if self.is_world_process_zero():
            write_model_card(self, self.args.output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """A push during training (hub_strategy 'every_save'): the checkpoint's allow-listed files (weights, ledger,
        DP card) are copied to output_dir and pushed from there through the allow-list, never the checkpoint's
        trainer_state.json, optimizer / RNG state or training_args.bin (the Trainer's own push sends them)."""
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        check_hub_strategy(self.args)
        if not self.args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return
        from .hub import files_to_push, upload_run

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
        (`save_model` saves the adapters alone), plus the privacy ledger and model card."""
        from .lora import save_merged_model

        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            save_merged_model(self.model, output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        self._save_privacy_record(output_dir)

    def _save_privacy_record(self, output_dir: str) -> None:
        """The ledger and the model card that states the guarantee go next to every saved model."""
        if self.ledger is None or not self.args.should_save:
            return
        self.ledger.save(output_dir)
        from .model_card import write_model_card

        write_model_card(self, output_dir)
        if getattr(self, "continual_record", None) is not None:  # public → private: the switch and tr(H) record
            from .continual import save_record

            save_record(self.continual_record, output_dir)
