"""`DPTrainer.hyperparameter_search`: every trial spends the target ε, the search states its cost, and what a
search on private data may not do is refused."""

import csv
import json
import os
import re

import numpy as np
import optuna
import pytest

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.tiny import tiny_vit
from hf_dp_repr.training.plan import plan_run
from hf_dp_repr.tuning.selection_privacy import TrialCount, rdp_curve, search_epsilon

TARGET = 2.0


def accuracy(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def make_trainer(digits, tmp_path, n=256, data=None, **kw):
    kw = {"eval_strategy": "no", "accountant": "rdp", **kw}  # RDP: calibrating σ costs less CPU than PRV
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=TARGET, target_delta=1e-4, report_to="none",
                               save_strategy="no", disable_tqdm=True, logging_strategy="no",
                               per_device_eval_batch_size=512, **kw)
    data = digits["train"].select(range(n)) if data is None else data
    return DPTrainer(model_init=lambda: tiny_vit(), args=args, train_dataset=data,
                     eval_dataset=digits["test"].select(range(120)), compute_metrics=accuracy)


def small_space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True),
            "max_steps": trial.suggest_categorical("max_steps", [2, 4]),
            "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [32, 64]),
            "trainable_scope": trial.suggest_categorical("trainable_scope", ["blocks:1", "all", "biases,head"]),
            "lp_steps": trial.suggest_categorical("lp_steps", [0.0, 0.5])}


def space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True),
            "num_train_epochs": trial.suggest_categorical("num_train_epochs", [1, 2]),
            "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [32, 128]),
            "trainable_scope": trial.suggest_categorical("trainable_scope", ["blocks:1", "all", "biases,head"]),
            "lp_steps": trial.suggest_categorical("lp_steps", [0.0, 0.3])}


def read_rows(tmp_path):
    with open(os.path.join(tmp_path, "hp_search_trials.csv")) as f:
        return list(csv.DictReader(f))


def check_four_trial_search(trainer, hp_space, tmp_path):
    best = trainer.hyperparameter_search(hp_space=hp_space, n_trials=4, direction="maximize", tuning_data="public")
    rows = read_rows(tmp_path)
    assert len(rows) == 4 and {r["tuning_data"] for r in rows} == {"public"}
    for r in rows:
        assert float(r["epsilon_spent"]) == pytest.approx(TARGET, rel=0.01)
        assert r["epsilon_search_total"] == ""  # public data: not charged, and the CSV says so
    # σ is recalibrated per trial: the schedules that differ in (batch, length) get different σ
    schedules = {(r["per_device_train_batch_size"], r.get("num_train_epochs"), r.get("max_steps")):
                 r["sigma"].split(" / ")[0] for r in rows}
    if len(schedules) > 1:
        assert len(set(schedules.values())) == len(schedules)
    assert best.objective == max(float(r["objective"]) for r in rows)
    assert os.path.exists(tmp_path / "hp_search_trials.png")
    assert os.path.exists(tmp_path / "best_trial" / "model.safetensors")
    # the arguments are back to what the user gave after the search
    assert trainer.args.per_device_train_batch_size == 8 and trainer.args.lp_steps == 0


def test_four_trial_search_every_trial_spends_the_target(digits, tmp_path):
    check_four_trial_search(make_trainer(digits, tmp_path), small_space, tmp_path)


@pytest.mark.slow
def test_four_trial_search_on_all_of_digits_with_evaluation_every_epoch(digits, tmp_path):
    # The acceptance run: the whole digits training set, 1 or 2 epochs per trial, evaluated every epoch.
    check_four_trial_search(make_trainer(digits, tmp_path, n=1437, eval_strategy="epoch"), space, tmp_path)


class PruneAfterFirstTrial(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return trial.number > 0


@pytest.mark.slow  # two trials evaluated every epoch
def test_pruning_goes_through_evaluation(digits, tmp_path):
    trainer = make_trainer(digits, tmp_path, eval_strategy="epoch")
    fixed = lambda t: {"num_train_epochs": t.suggest_categorical("num_train_epochs", [2]),  # noqa: E731
                       "per_device_train_batch_size": t.suggest_categorical("per_device_train_batch_size", [64])}
    trainer.hyperparameter_search(hp_space=fixed, n_trials=2, direction="maximize", pruner=PruneAfterFirstTrial(),
                                  tuning_data="public")
    first, second = read_rows(tmp_path)
    assert (first["state"], second["state"]) == ("COMPLETE", "PRUNED")
    assert float(second["epsilon_spent"]) < float(second["epsilon_planned"])  # stopped after its first epoch


def test_private_search_reports_the_papernot_steinke_total(digits, tmp_path):
    trainer = make_trainer(digits, tmp_path)
    small = lambda t: {"max_steps": t.suggest_categorical("max_steps", [2, 4]),  # noqa: E731
                       "per_device_train_batch_size": t.suggest_categorical("per_device_train_batch_size", [32, 64])}
    best = trainer.hyperparameter_search(hp_space=small, direction="maximize", tuning_data="private",
                                         trial_count=TrialCount.geometric(0.5), eval_data_public=True)
    rows = read_rows(tmp_path)
    assert rows and best is not None
    # By hand: the worst RDP curve over the 4 schedules the space can draw, through the Papernot-Steinke bound
    # (whose formulas test_selection_privacy checks against hand computations).
    curves = []
    for steps in (2, 4):
        for batch in (32, 64):
            args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=TARGET, target_delta=1e-4,
                                       max_steps=steps, per_device_train_batch_size=batch, report_to="none",
                                       accountant="rdp")
            curves.append(rdp_curve([(p.noise_multiplier, p.sample_rate, p.steps) for p in plan_run(args, 256).phases]))
    expected = search_epsilon(np.max(curves, axis=0), TrialCount.geometric(0.5), 1e-4)
    # Only the best trial leaves: the number of trials K (and the best one's index, a bound on K) stays secret.
    assert len(rows) == 1 and rows[0]["trial"] == best.run_id == "best"
    r = rows[0]
    assert float(r["epsilon_search_total"]) == pytest.approx(expected, rel=1e-9)
    assert float(r["epsilon_spent"]) == pytest.approx(TARGET, rel=0.01)
    assert TARGET < expected
    assert r["tuning_data"] == "private" and float(r["objective"]) == best.objective
    assert not [p for p in os.listdir(tmp_path) if p.startswith("run-")]  # no per-trial directory


@pytest.mark.parametrize("kw,match", [
    (dict(tuning_data="private", n_trials=4, eval_data_public=True), "must be random and secret"),
    (dict(tuning_data="private", trial_count=TrialCount.geometric(0.5)), "eval_data_public=True"),
    (dict(tuning_data="private", trial_count=TrialCount.geometric(0.5), eval_data_public=True,
          sampler=optuna.samplers.TPESampler()), "adaptive sampler"),
    (dict(n_trials=2, hp_space=lambda t: {"target_epsilon": 8.0}, tuning_data="public"),
     "define the privacy guarantee"),
    (dict(tuning_data="private", trial_count=TrialCount.geometric(0.5), eval_data_public=True,
          hp_space=lambda t: {"max_steps": t.suggest_int("max_steps", 2, 4)}), "suggest_categorical"),
    (dict(tuning_data="somewhere", n_trials=2), "tuning_data='somewhere'"),
])
def test_what_cannot_be_private_is_refused(kw, match, digits, tmp_path):
    trainer = make_trainer(digits, tmp_path, max_steps=2)
    with pytest.raises(ValueError, match=match):
        trainer.hyperparameter_search(direction="maximize", **kw)


def test_default_space_gives_valid_dp_arguments_for_every_draw(digits, tmp_path):
    # No training: 40 draws of the default space set on the arguments and validated (as each trial does).
    from hf_dp_repr.scope import phase_scopes
    from hf_dp_repr.tuning.search import DPSearch, default_dp_hp_space

    trainer = make_trainer(digits, tmp_path)
    search = DPSearch(trainer, lambda t: default_dp_hp_space(t, depth=4, dataset_size=256), "public", None)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        search.space(study.ask())
        a = trainer.args
        seen.add((a.trainable_blocks, a.trainable_groups))
        assert a.per_device_train_batch_size <= 128 and a.clipping in ("flat", "automatic")
        phase_scopes(tiny_vit(), a.trainable_blocks, a.lp_steps, None, a.trainable_groups)  # every scope is valid
    assert (0, None) in seen and (None, "biases,head") in seen and (None, None) in seen


def test_trainable_scope_is_all_an_int_k_or_a_groups_spec():
    from hf_dp_repr.tuning.search import scope_arguments

    assert scope_arguments("all") == {"trainable_blocks": None, "trainable_groups": None}
    assert scope_arguments(2) == {"trainable_blocks": 2, "trainable_groups": None}  # the short form of ...
    assert scope_arguments("last:2,final,head") == {"trainable_blocks": None, "trainable_groups": "last:2,final,head"}
    assert scope_arguments("2") == {"trainable_blocks": None, "trainable_groups": "2"}  # a string: block index 2
    with pytest.warns(DeprecationWarning, match="'blocks:2' is the old spelling of trainable_scope=2"):
        assert scope_arguments("blocks:2") == scope_arguments(2)


# ---- a private search releases its best trial and nothing else ----------------------------------------------------
MADE = []  # every model model_init made (module-level: not reachable from the trainer through model_init)


def counted_tiny_vit():
    MADE.append(tiny_vit())
    return MADE[-1]


def reachable(root, wanted):
    """The objects `wanted(obj)` picks that can be reached from `root` through attributes, containers, bound
    methods, closures and partials (not through modules, classes or a function's globals)."""
    import functools
    import types

    import torch

    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, str, bytes, int, float, torch.Tensor)):
            continue
        seen.add(id(obj))
        if wanted(obj):
            found.append(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.extend([obj.__self__, obj.__func__])
        elif isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None)
            stack.extend(obj.__defaults__ or ())
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, obj.args, obj.keywords])
        if hasattr(obj, "__dict__") and not isinstance(obj, types.FunctionType):
            stack.extend(vars(obj).values())
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                stack.append(getattr(obj, name))
    return found


def test_a_private_search_leaves_the_best_trial_its_own_record_and_nothing_of_the_others(digits, tmp_path,
                                                                                        monkeypatch):
    from optuna.study import Study
    from optuna.trial import BaseTrial
    from torch.optim import Optimizer

    from hf_dp_repr.privacy.randomness import DPRandomness
    from hf_dp_repr.tuning.search import DPSearch

    monkeypatch.setattr(TrialCount, "sample", lambda self, rng=None: 3)  # K is secret and random; fixed here
    scores = iter([3.0, 2.0, 1.0])  # the first trial is the best: the other two differ from it
    MADE.clear()
    trainer = make_trainer(digits, tmp_path)
    trainer.model_init = counted_tiny_vit

    def space(t):  # data-free: the first trial draws batch 50 and 3 steps, the others batch 20 and 2 steps
        t.suggest_categorical("per_device_train_batch_size", [20, 50])
        t.suggest_categorical("max_steps", [2, 3])
        first = t.number == 0
        return {"per_device_train_batch_size": 50 if first else 20, "max_steps": 3 if first else 2}

    best = trainer.hyperparameter_search(hp_space=space, compute_objective=lambda metrics: next(scores),
                                         direction="maximize", tuning_data="private",
                                         trial_count=TrialCount.geometric(0.5), eval_data_public=True)
    assert best.objective == 3.0
    # on disk: the best trial's own ledger, and a card that states the whole search's ε
    ledger = json.loads((tmp_path / "best_trial" / "privacy_ledger.json").read_text())
    assert [(p["expected_batch_size"], p["steps"]) for p in ledger["phases"]] == [(50, 3)]
    card = (tmp_path / "best_trial" / "README.md").read_text()
    assert "(expected logical batch 50)" in card and "| steps taken / planned | 3 / 3 |" in card
    (row,) = read_rows(tmp_path)
    stated = float(re.search(r"\(ε = ([\d.]+), δ = 0.0001\)-differentially private", card).group(1))
    curves = {relation: np.max([rdp_curve(plan_run(DPTrainingArguments(
        output_dir=str(tmp_path), target_epsilon=TARGET, target_delta=1e-4, max_steps=steps, accountant="rdp",
        per_device_train_batch_size=batch, report_to="none"), 256).history(), neighboring=relation)
        for steps in (2, 3) for batch in (20, 50)], axis=0) for relation in ("add_remove", "replace_one")}
    totals = {r: search_epsilon(c, TrialCount.geometric(0.5), 1e-4) for r, c in curves.items()}
    assert float(row["epsilon_search_total"]) == pytest.approx(totals["add_remove"], rel=1e-9)  # the plan's relation
    assert totals["replace_one"] <= stated <= totals["replace_one"] * 1.001  # the card: what holds with n stated
    assert "hyperparameter search on the private data" in card
    # on the trainer: the best trial's weights, ledger and state; no trial, study, optimizer, secret or other model
    assert trainer.ledger.to_dict() == ledger and trainer.state.global_step == 3
    assert {e["step"] for e in trainer.state.log_history} == {3} and trainer.objective == 3.0
    assert getattr(trainer, "_trial", None) is None
    trial_models = {id(m) for m in MADE[:-1]}  # one per trial; MADE[-1]: the best trial's weights, reloaded
    assert len(trial_models) == 3 and trainer.model is MADE[-1]
    leaks = reachable(trainer, lambda o: isinstance(o, (BaseTrial, Study, DPSearch, DPRandomness, Optimizer))
                      or id(o) in trial_models)
    assert leaks == []


def test_a_private_search_with_a_privacy_unit_counts_units(digits, tmp_path, monkeypatch):
    monkeypatch.setattr(TrialCount, "sample", lambda self, rng=None: 1)
    data = digits["train"].select(range(300)).add_column("user_id", [i // 5 for i in range(300)])  # 60 users
    trainer = make_trainer(digits, tmp_path, data=data, privacy_unit="user_id")
    space = lambda t: {"max_steps": t.suggest_categorical("max_steps", [2]),  # noqa: E731
                       "per_device_train_batch_size": t.suggest_categorical("per_device_train_batch_size", [10])}
    trainer.hyperparameter_search(hp_space=space, direction="maximize", tuning_data="private",
                                  trial_count=TrialCount.geometric(0.5), eval_data_public=True)
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=TARGET, target_delta=1e-4, max_steps=2,
                               per_device_train_batch_size=10, report_to="none", accountant="rdp",
                               privacy_unit="user_id")
    by_units = search_epsilon(rdp_curve(plan_run(args, 60).history()), TrialCount.geometric(0.5), 1e-4)
    by_rows = search_epsilon(rdp_curve(plan_run(args, 300).history()), TrialCount.geometric(0.5), 1e-4)
    (row,) = read_rows(tmp_path)
    assert float(row["epsilon_search_total"]) == pytest.approx(by_units, rel=1e-9) and by_units > by_rows * 1.01
    assert json.loads((tmp_path / "best_trial" / "privacy_ledger.json").read_text())["dataset_size"] == 60


def test_a_search_that_does_not_say_what_it_tunes_on_is_refused_before_any_trial(digits, tmp_path):
    """The default used to be "public": four trials ran on the trainer's private set with one warning, and
    best_trial/'s card stated the trial's ε without the search."""
    from hf_dp_repr.errors import TuningDataError

    trainer = make_trainer(digits, tmp_path, n=64, max_steps=1)
    with pytest.raises(TuningDataError, match=r"tuning_data is not given.*64 rows.*Fix: tuning_data='private'.*"
                                              r"tuning_data='public' or 'held_out'"):
        trainer.hyperparameter_search(n_trials=4, direction="maximize")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no trial ran, nothing written


def test_public_tuning_on_the_private_training_set_is_refused(digits, tmp_path):
    from hf_dp_repr.errors import TuningDataError

    one_step = lambda t: {"max_steps": t.suggest_categorical("max_steps", [1])}  # noqa: E731
    # A DP run on the data, then a search that calls the same data public: refused before any work.
    trainer = make_trainer(digits, tmp_path / "a", n=200, max_steps=1)
    trainer.train()
    with pytest.raises(TuningDataError, match=r"tuning_data='public'.*private training set.*tuning_data='private'"):
        trainer.hyperparameter_search(hp_space=one_step, n_trials=1, tuning_data="public")
    same_rows = make_trainer(digits, tmp_path / "b", n=200)  # another trainer, the same data
    with pytest.raises(TuningDataError, match="tuning_data='held_out'"):
        same_rows.hyperparameter_search(hp_space=one_step, n_trials=1, tuning_data="held_out")
    assert not (tmp_path / "a" / "hp_search_trials.csv").exists()
    assert not [p for p in (tmp_path / "b").rglob("*") if p.is_file()]  # nothing written
    # A search that calls its data public, then the final run on that data: refused (its card would state the
    # run's ε without the search's).
    trainer = make_trainer(digits, tmp_path / "c", n=150)
    best = trainer.hyperparameter_search(hp_space=one_step, n_trials=1, tuning_data="public")
    for key, value in best.hyperparameters.items():
        setattr(trainer.args, key, value)
    with pytest.raises(TuningDataError, match="tuning_data='public'.*tuned on this training set"):
        trainer.train()
    trainer.train_dataset = digits["train"].select(range(150, 300))  # other data: fine
    trainer.train()


def test_a_private_search_sends_no_trial_to_a_tracker(digits, tmp_path):
    trainer = make_trainer(digits, tmp_path, max_steps=2)
    trainer.args.report_to = ["tensorboard"]  # each trial's logs would reach it: K and every trial's loss
    with pytest.raises(ValueError, match=r"report_to=\['tensorboard'\].*report_to='none'"):
        trainer.hyperparameter_search(tuning_data="private", trial_count=TrialCount.geometric(0.5),
                                      eval_data_public=True, direction="maximize")
    assert not (tmp_path / "hp_search_trials.csv").exists()
