"""`DPTrainer.hyperparameter_search`: the Trainer's search under DP (a mixin placed before `Trainer`), run by a
registered backend (`backends`; "optuna" is `hf_dp_repr.tuning.search`), and what the trainer does around
a search: the data it tuned on, the best trial's record. (Each trial's model gets its head_init and scope when its
training starts: `DPTrainer.get_train_dataloader`.)"""

from __future__ import annotations

import copy

from .backends import search_backend
from .tuning_data import check_training_data, check_tuning_data_stated


class DPSearchMixin:
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
        run_search = search_backend(str(getattr(backend, "value", backend)))
        check_tuning_data_stated(tuning_data, self.train_dataset)
        return run_search(self, hp_space, compute_objective, n_trials, direction, hp_name, tuning_data, trial_count,
                          eval_data_public, keep_best_model, **kwargs)

    def _check_training_data(self) -> None:
        """First thing a `train()` outside a search does: refuse the data this trainer's search tuned on (see
        `tuning_data`); a new run is not the model a private search selected."""
        if self.hp_search_backend is not None:  # a trial of the search
            return
        check_training_data(self)
        self._search_record = None

    # ---- after a search: the best trial's own record, nothing of the others ----------------------------------
    def _trial_record(self) -> dict:
        """What the best trial leaves: its weights, arguments, ledger, state and score (copies)."""
        return {"weights": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "args": copy.deepcopy(self.args), "ledger": copy.deepcopy(self.ledger),
                "state": copy.deepcopy(self.state), "objective": self.objective}

    def _end_search(self, before: dict, record: dict | None, data: tuple[str, str]) -> None:
        """Put the trainer back as it was before the search (`before`: its attributes then), so that no trial's
        model, optimizer, secret, optuna trial or logs stay reachable, then give it the best trial's own weights,
        scope, ledger and state (`record`, or none). `data` is (fingerprint, tuning_data) of what it tuned on."""
        self.__dict__.clear()
        self.__dict__.update(before)
        self._searched_data = {**(before.get("_searched_data") or {}), data[0]: data[1]}
        handler = self.callback_handler  # the Trainer set the last trial's objects on it, in place
        handler.optimizer = handler.lr_scheduler = handler.train_dataloader = handler.eval_dataloader = None
        if record is not None:
            self.model = self.call_model_init()
            self.model.load_state_dict(record["weights"])
            self._set_scopes(self.model, record["args"])
            self.ledger, self._plan = record["ledger"], record["ledger"].plan
            self.state, self.objective = record["state"], record["objective"]
            self.state.trial_name = None  # hp_name(trial) may hold the trial's number, a bound on K
        self.model_wrapped = handler.model = self.model
