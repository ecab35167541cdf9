"""`DPTrainer`, part 2 (its base class): every `Trainer` member it overrides for what leaves or re-enters a run —
logs, evaluation and prediction, saved models and checkpoints, loads, Hub pushes — and its search.

Each override is defined once, here, and composes the features it involves in the order they apply, e.g.
`save_model`: the weight average swapped in (`averaging`), the preconditioning folded into the head
(`preconditioned_probe`), then the model saved with its ledger and DP card (`checkpoints.saving`). The features keep
their helpers (functions and context managers); part 1 (`trainer.DPTrainer`) builds the run and trains it.
"""

from __future__ import annotations

import os
import shutil

from torch.utils.data import DataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..privacy.engine import DPEngine
from ..privacy.ledger import PrivacyLedger
from ..scope.cached_head import HEAD_INPUTS_KEY
from ..scope.prefix_cache import STATES_KEY
from . import TRAINER_LOGGER
from .averaging import WeightAverage, averaged_weights, is_averaging, read_average
from .cached_features import cached_eval_inputs, from_cached_states, head_prediction
from .checkpoints.output_dir import STAGING_DIR
from .checkpoints.saving import (
    commit_checkpoint,
    load_weights,
    push_checkpoint,
    save_merged,
    save_privacy_record,
    take_card_args,
)
from .eval_overlap import metric_prefix
from .hp_search.trials import run_search
from .preconditioned_probe import folded_head
from .privacy_report import DPPublishedLogs

logger = logging.get_logger(TRAINER_LOGGER)


class DPTrainerOutputs(DPPublishedLogs):
    """What leaves a `DPTrainer` run, and what a checkpoint brings back (see the module docstring)."""

    engine: DPEngine | None = None  # the run's DP machinery (made by DPTrainer when training starts)
    sharded = False  # FSDP2: saves and loads are collectives, written by rank 0 (`checkpoints.sharded`)
    weight_average: WeightAverage | None = None  # ema_decay (`averaging`)
    _pending_average: dict | None = None  # a checkpoint's averaging state, read with its weights
    _preconditioned: str | None = None  # the head's path while the public preconditioner is in front of it
    _spent_dir: str | None = None  # where privacy_spent.json is kept up to date (when a resume can need it)
    _staging_checkpoint = False  # True while the Trainer writes a checkpoint (into the staging folder)

    # ---- privacy: the ledger, ε, and logs that carry it -----------------------------------------------------------
    @property
    def ledger(self) -> PrivacyLedger | None:
        """The run's privacy ledger (the engine's): its plan and the steps taken. None before training."""
        return None if self.engine is None else self.engine.ledger

    @ledger.setter
    def ledger(self, ledger: PrivacyLedger) -> None:
        """A finished run's ledger (a checkpoint's, a search's best trial's): what the trainer reports from now on."""
        engine = DPEngine(ledger.plan, ledger=ledger, log=logger)
        engine.clipping_engine, self.engine = self.clipping_engine, engine

    @property
    def clipping_engine(self) -> str | None:
        """The per-example clipping that ran: "ghost" or "hooks" (same clipping, same guarantee)."""
        return None if self.engine is None else self.engine.clipping_engine

    def epsilon(self) -> float | None:
        """ε spent so far (computed by the ledger's accountant, for its neighbouring relation), None before training."""
        return None if self.ledger is None else self.engine.epsilon()

    def floating_point_ops(self, inputs) -> int:
        """0: the Trainer's count (6 · parameters · the micro-batch's tokens or pixels) summed over a run would give
        Σ|B_t|, the sizes of the secret Poisson batches; so a DP run counts none (`trainer_state.json` holds
        `total_flos: 0`) and its logs carry no `total_flos`."""
        return 0

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        # The Trainer's `grad_norm` would be the norm of a non-private gradient: never log it; nor a FLO count (above).
        logs.pop("grad_norm", None)
        logs.pop("total_flos", None)
        privacy = {}
        if self.ledger is not None:
            privacy["epsilon"] = self.epsilon()
            if self.ledger.plan.adaptive_clipping is not None:  # C now: from C_0 and the noisy counts alone
                privacy["clip_norm"] = self.ledger.clip_norm
            if len(self.ledger.plan.phases) > 1:
                privacy.update({f"epsilon_{name}": eps for name, eps in self.engine.epsilon_by_phase().items()})
        logged = {**logs, **privacy}
        super().log(logged, *args, **kwargs)
        # What was logged reaches the caller (the epoch, a subclass's metrics, keys dropped or renamed by
        # DPPublishedLogs); ε does not: eval metrics that a hyperparameter search scores must stay free of it.
        logs.clear()
        logs.update({k: v for k, v in logged.items() if k not in privacy})

    # ---- evaluation and prediction: on the averaged weights, cached features, private sets named train_* --------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        private = ()
        if not isinstance(dataset, dict):  # a dict: the Trainer evaluates each entry through this method again
            prefix = metric_prefix(self, dataset, metric_key_prefix)
            if prefix != metric_key_prefix:  # a set drawn from the training data: a subclass's own eval metrics
                private = (f"{metric_key_prefix}_", "eval_")  # (TRL's eval_*) too, renamed by DPPublishedLogs
            metric_key_prefix = prefix
        saved, self._private_eval_prefixes = self._private_eval_prefixes, private
        try:
            with averaged_weights(self):
                return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self._private_eval_prefixes = saved

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        with averaged_weights(self):
            return super().predict(test_dataset, ignore_keys=ignore_keys,
                                   metric_key_prefix=metric_prefix(self, test_dataset, metric_key_prefix))

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """When training ran on cached features, evaluation does too (`cached_features.cached_eval_inputs`)."""
        cached = cached_eval_inputs(self, eval_dataset)
        if cached is None:
            return super().get_eval_dataloader(eval_dataset)
        items, collate = cached
        return self.accelerator.prepare(DataLoader(items, batch_size=self.args.eval_batch_size, collate_fn=collate,
                                                   num_workers=self.args.dataloader_num_workers))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        features = inputs.pop(HEAD_INPUTS_KEY, None)
        if features is not None:  # the probe's head alone, on the cached inputs
            return head_prediction(self, features, inputs["labels"], prediction_loss_only)
        with from_cached_states(self, inputs.pop(STATES_KEY, None)):  # the trained blocks alone, if cached
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    # ---- saving: the released weights (average, plain head) with the ledger and the DP card --------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """As the Trainer's, of the weights a run releases (the average with ema_decay, the plain head with
        probe_preconditioning), plus the ledger and the DP card; a sharded model is gathered (every rank must call
        it) and written by rank 0; a checkpoint of an averaging run also holds the raw iterate, for resume."""
        averaging = is_averaging(self)
        with averaged_weights(self), folded_head(self):
            if self.sharded:
                from .checkpoints.sharded import save_sharded_model

                save_sharded_model(self, output_dir or self.args.output_dir)
                if self.args.push_to_hub and not _internal_call:  # as the Trainer's save_model
                    self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
            else:
                super().save_model(output_dir, _internal_call=_internal_call)
            if self.args.should_save:  # peft records the base model's local path; it must not be pushed
                from ..hub.public_names import public_adapter_config

                public_adapter_config(output_dir or self.args.output_dir)
            save_privacy_record(self, output_dir or self.args.output_dir)
        if averaging and self._staging_checkpoint and (self.args.should_save or self.sharded):
            self.weight_average.save(output_dir, write=self.args.should_save)  # sharded: every rank gathers

    def save_merged_model(self, output_dir: str | None = None) -> None:
        """For a LoRA (PEFT) model: save the base weights with the adapters merged in, as a plain HF model
        (`save_model` saves the adapters alone), plus the privacy ledger and model card."""
        save_merged(self, output_dir)

    def save_metrics(self, split, metrics, combined=True) -> None:
        """As the Trainer's, but without the `train_*` metrics (computed on the private data outside DP-SGD) and as
        valid JSON (ε = ∞ as null): these files may be pushed."""
        if self.is_world_process_zero():
            from ..hub.push import save_public_metrics

            os.makedirs(self.args.output_dir, exist_ok=True)  # not made by __init__ (refusals write nothing)
            save_public_metrics(self.args.output_dir, split, metrics, combined)

    # ---- checkpoints: whole or absent, restored exactly ---------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, STAGING_DIR) if self._staging_checkpoint else run_dir

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written into `<run_dir>/.checkpoint-staging/checkpoint-N`; then the arguments
        (JSON) and the ledger, last; every file flushed to disk; then renamed to `<run_dir>/checkpoint-N` and the
        old checkpoints rotated out (`checkpoints.saving.commit_checkpoint`). A kill at any point leaves the
        previous checkpoints as they were."""
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
            commit_checkpoint(self, staging, final, run_dir)
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.sharded:  # the Trainer's optimizer.pt of a sharded model would hold rank 0's shards only
            return super()._save_optimizer_and_scheduler(output_dir)
        from .checkpoints.sharded import save_sharded_optimizer

        save_sharded_optimizer(self, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.sharded or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        from .checkpoints.sharded import load_sharded_optimizer

        load_sharded_optimizer(self, checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights restored exactly, or refused; the checkpoint's weight average read for `start_average`."""
        self._pending_average = read_average(resume_from_checkpoint, self.args.ema_decay)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_weights(self, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            super()._load_best_model()
        else:
            logger.info(f"Loading best model from {self.state.best_model_checkpoint} "
                        f"(score: {self.state.best_metric}).")
            load_weights(self, self.state.best_model_checkpoint)
        if self.weight_average is not None:  # the best checkpoint's model file is its average: keep it
            self.weight_average.raw = {}

    # ---- Hub: every push goes through hf_dp_repr.hub's allow-list -----------------------------------------------
    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Check login and write access first (`hf_dp_repr.hub.check_hub_access`), then create the repository."""
        if self.is_world_process_zero():
            from ..hub.push import check_hub_access

            check_hub_access(self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir)), token)
        super().init_hf_repo(token=token, private=private)

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, private: bool | None = None, **kwargs):
        """Save, then upload the run through `hf_dp_repr.hub.push_dp_model`: an allow-list of files (weights,
        metrics, representation laws, privacy ledger, the DP model card), never checkpoints or training_args.bin.
        `hub_model_id=` names the repository (default: args.hub_model_id, else output_dir's name); the Trainer's card
        keywords (license, tags, language, model_name, finetuned_from, dataset) go into the DP card; others are
        refused (`ModelCardInfo.with_trainer_card_args`)."""
        from ..hub.push import push_dp_model

        repo_id = kwargs.pop("hub_model_id", None) or self.hub_model_id or self.args.hub_model_id
        take_card_args(self, (), kwargs)
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
        from ..hub.card import write_model_card

        take_card_args(self, args, kwargs)
        if self.is_world_process_zero():
            write_model_card(self, self.args.output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        push_checkpoint(self, checkpoint_folder)  # the allow-listed files of the checkpoint, through output_dir

    # ---- hyperparameter search -------------------------------------------------------------------------------
    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int | None = None,
                              direction: str = "minimize", backend="optuna", hp_name=None,
                              tuning_data: str | None = None, trial_count=None, eval_data_public: bool = False,
                              keep_best_model: bool = True, **kwargs):
        """The Trainer's Optuna search under DP: every trial spends exactly the target (ε, δ) and the search states
        its own cost. `tuning_data` (required: the trials train on `train_dataset`, which a DPTrainer holds as
        private unless told otherwise): "public"/"held_out" (the trainer's train_dataset is public data, or
        individuals held out from the private set: the search is charged to no budget) or "private" (accounted with
        Papernot & Steinke; needs `trial_count`, a `TrialCount`, and a public `eval_dataset`, stated with
        `eval_data_public=True`). `hp_space` returns DPTrainingArguments fields and optionally `trainable_scope`
        ("all", "blocks:k" or a trainable_groups spec). See `hf_dp_repr.tuning.search`.
        """
        return run_search(self, hp_space, compute_objective, n_trials, direction, backend, hp_name, tuning_data,
                          trial_count, eval_data_public, keep_best_model, **kwargs)

