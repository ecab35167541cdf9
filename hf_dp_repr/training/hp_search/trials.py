"""`DPTrainer.hyperparameter_search`: the Trainer's search under DP, run by a registered backend (`backends`;
"optuna" is `hf_dp_repr.tuning.search`), and what the trainer does around a search: the data it tuned on, the best
trial's record. (Each trial's model gets its head_init and scope when its
training starts: `DPTrainer.get_train_dataloader`.)"""

from __future__ import annotations

import copy

from .backends import search_backend
from .tuning_data import check_training_data, check_tuning_data_stated


def run_search(trainer, hp_space, compute_objective, n_trials, direction, backend, hp_name, tuning_data, trial_count,
               eval_data_public, keep_best_model, **kwargs):
    """`DPTrainer.hyperparameter_search`: `tuning_data` stated, then the registered backend runs the search."""
    search = search_backend(str(getattr(backend, "value", backend)))
    check_tuning_data_stated(tuning_data, trainer.train_dataset)
    return search(trainer, hp_space, compute_objective, n_trials, direction, hp_name, tuning_data, trial_count,
                  eval_data_public, keep_best_model, **kwargs)


def check_not_tuned_on(trainer) -> None:
    """First thing a `train()` outside a search does: refuse the data this trainer's search tuned on (see
    `tuning_data`); a new run is not the model a private search selected."""
    if trainer.hp_search_backend is not None:  # a trial of the search
        return
    check_training_data(trainer)
    trainer._search_record = None


# ---- after a search: the best trial's own record, nothing of the others ----------------------------------
def trial_record(trainer) -> dict:
    """What the best trial leaves: its weights, arguments, ledger, state and score (copies)."""
    return {"weights": {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()},
            "args": copy.deepcopy(trainer.args), "ledger": copy.deepcopy(trainer.ledger),
            "state": copy.deepcopy(trainer.state), "objective": trainer.objective}


def end_search(trainer, before: dict, record: dict | None, data: tuple[str, str]) -> None:
    """Put the trainer back as it was before the search (`before`: its attributes then), so that no trial's
    model, optimizer, secret, optuna trial or logs stay reachable, then give it the best trial's own weights,
    scope, ledger and state (`record`, or none). `data` is (fingerprint, tuning_data) of what it tuned on."""
    trainer.__dict__.clear()
    trainer.__dict__.update(before)
    trainer._searched_data = {**(before.get("_searched_data") or {}), data[0]: data[1]}
    handler = trainer.callback_handler  # the Trainer set the last trial's objects on it, in place
    handler.optimizer = handler.lr_scheduler = handler.train_dataloader = handler.eval_dataloader = None
    if record is not None:
        trainer.model = trainer.call_model_init()
        trainer.model.load_state_dict(record["weights"])
        trainer._set_scopes(trainer.model, record["args"])
        trainer.ledger, trainer._plan = record["ledger"], record["ledger"].plan
        trainer.state, trainer.objective = record["state"], record["objective"]
        trainer.state.trial_name = None  # hp_name(trial) may hold the trial's number, a bound on K
    trainer.model_wrapped = handler.model = trainer.model
