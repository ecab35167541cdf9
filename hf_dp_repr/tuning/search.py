"""`DPTrainer.hyperparameter_search`: an Optuna search in which every trial spends exactly the target (ε, δ), and
which states what the search itself costs.

Each trial sets its hyperparameters on the arguments, then `train()` plans the run afresh (`plan.plan_run`), so σ
is recalibrated for the trial's batch size, length and phases: every trial spends the target ε. Hyperparameters
that would change the guarantee itself (target ε or δ, σ, accountant, sampling, noise seed) cannot be searched.

Two modes (`tuning_data`, required: the trainer's train_dataset is held private unless the mode says otherwise):
- "public" or "held_out": the trials train on data that is NOT the private training set the final model
  protects (public data, or individuals held out from it). The search spends none of the final run's budget;
  nothing about the held-out individuals is claimed. The mode is written in the log and in every CSV row. It is
  checked by dataset fingerprint (`hf_dp_repr.training.hp_search.tuning_data`): such a search on the training set of an
  earlier DP run of the process, or a DP run of the same trainer on the data its search tuned on, is refused
  (`TuningDataError`).
- "private": the trials train on the private data, and the search is accounted with Papernot & Steinke (2022,
  `selection_privacy`): the number of trials K is drawn from `trial_count` with OS-entropy randomness (never from
  `args.seed`); hyperparameters are drawn independently of the data (Optuna's RandomSampler on a secret seed: an
  adaptive sampler such as TPE, or a pruner, would let one trial depend on the private results of others, which
  the theorem does not cover); only the best trial is released (its model, kept in memory and saved under
  `output_dir/best_trial` with its own ledger and a card that states the whole search's ε, and its score). K itself
  must stay secret (the bound holds for the best of a random, unknown number of runs; knowing K = k leaves the best
  of k fixed runs): the CSV, the plot, the summary log and the returned `BestRun` (run_id "best") show the best trial
  only, never the trial count or index, and the returned trainer holds the best trial's weights, ledger and state
  and nothing of the others (no optuna trial or study, optimizer, secret or logs). With a `privacy_unit`, the bound
  counts units. The Trainer's console logs of each trial and the search's wall time still reveal K: keep them
  local. The score is computed on `eval_dataset` outside DP-SGD: the theorem covers it only if that data is public,
  so the caller must state `eval_data_public=True`.

Writes `hp_search_trials.csv` (each trial's hyperparameters: what `hp_space` set and anything else the trial drew,
e.g. in `model_init(trial)`) and `hp_search_trials.png` into `args.output_dir`.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import secrets
import warnings

from transformers.trainer_utils import BestRun, HPSearchBackend, default_compute_objective
from transformers.utils import logging

from ..errors import DPConfigError
from ..training.hp_search.trials import end_search, trial_record
from ..training.hp_search.tuning_data import check_search_data
from ..training.plan import plan_run
from .search_report import announce, write_table
from .selection_privacy import TrialCount, rdp_curve, search_epsilon, single_run_epsilon

logger = logging.get_logger(__name__)

TUNING_DATA = ("public", "held_out", "private")
# Arguments that set the privacy schedule (σ is recalibrated from them): they change each trial's RDP curve.
SCHEDULE_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_steps",
                 "lp_steps", "lp_epsilon_fraction", "lp_per_device_train_batch_size")
# Arguments that define the guarantee: a search over them would compare runs with different guarantees.
FORBIDDEN_KEYS = ("target_epsilon", "target_attack_tpr_at_fpr", "target_delta", "noise_multiplier", "accountant",
                  "neighboring", "poisson_sampling", "noise_seed", "secure_mode", "seed")
SCOPE_KEY = "trainable_scope"  # "all", an int k (trainable_blocks=k) or a trainable_groups spec


def default_dp_hp_space(trial, depth: int, dataset_size: int) -> dict:
    """The default DP search space: learning rate, epochs, clipping norm and mode, logical batch, trainable scope
    and the share of steps spent linear probing first."""
    batches = [b for b in (32, 64, 128, 256) if b <= dataset_size // 2] or [max(1, dataset_size // 2)]
    scopes = [0, 1, max(1, depth // 2), depth, "all", "biases,head", "norms,head"]
    params = {
        "learning_rate": trial.suggest_float("learning_rate", 1e-4, 3e-2, log=True),
        "num_train_epochs": trial.suggest_categorical("num_train_epochs", [2, 5, 10]),
        "per_sample_max_grad_norm": trial.suggest_float("per_sample_max_grad_norm", 0.1, 10.0, log=True),
        "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", batches),
        "clipping": trial.suggest_categorical("clipping", ["flat", "automatic"]),
        SCOPE_KEY: trial.suggest_categorical(SCOPE_KEY, list(dict.fromkeys(scopes))),
    }
    if params[SCOPE_KEY] != 0:  # no probing phase before a linear probe
        params["lp_steps"] = trial.suggest_categorical("lp_steps", [0.0, 0.1, 0.3])
    return params


def scope_arguments(value) -> dict:
    """trainable_blocks / trainable_groups for a `trainable_scope`: "all" (or None), an int k (`trainable_blocks=k`,
    i.e. "last:k,final,head") or a `trainable_groups` spec; "blocks:k" is k's old spelling (DeprecationWarning)."""
    if value in (None, "all"):
        return {"trainable_blocks": None, "trainable_groups": None}
    if isinstance(value, str) and (old := re.fullmatch(r"blocks:(\d+)", value.strip())):
        warnings.warn(f"trainable_scope={value!r} is the old spelling of trainable_scope={int(old[1])}; 'blocks:k' "
                      "goes in 0.3", DeprecationWarning, stacklevel=3)
        value = int(old[1])
    k = isinstance(value, int) and not isinstance(value, bool)  # else a groups spec, checked by validate_dp_fields
    return {"trainable_blocks": value if k else None, "trainable_groups": None if k else value}


class DPSearch:
    """The state of one `DPTrainer.hyperparameter_search`: the arguments' baseline, the trials' records, the
    privacy schedules the search space can draw (mode "private")."""

    def __init__(self, trainer, hp_space, tuning_data: str, trial_count: TrialCount | None):
        self.trainer, self.user_space, self.tuning_data, self.trial_count = trainer, hp_space, tuning_data, trial_count
        self.baseline = copy.deepcopy(trainer.args)
        self.records: list[dict] = []
        self.schedule_choices: dict[str, list] = {}
        self._plans: dict[tuple, object] = {}

    # ---- each trial ---------------------------------------------------------------------------------
    def space(self, trial) -> dict:
        """Called by the Trainer's `_hp_search_setup`: sets the trial's arguments itself (the Trainer would cast
        0.3 to int for an argument whose current value is 0) and returns nothing left to set."""
        from ..training.arguments import validate_dp_fields

        params = dict(self.user_space(trial))
        bad = sorted(set(params) & set(FORBIDDEN_KEYS))
        if bad:
            raise DPConfigError(f"hyperparameter_search: hp_space sets {bad}, which define the privacy guarantee "
                                "itself; every trial must spend the same target (ε, δ): fix them in the arguments.")
        if SCOPE_KEY in params:
            params.update(scope_arguments(params.pop(SCOPE_KEY)))
        args = self.trainer.args
        for key in set(vars(self.baseline)) & ({k for r in self.records for k in r["_set"]} | set(params)):
            setattr(args, key, copy.deepcopy(getattr(self.baseline, key)))  # forget the previous trial's values
        unknown = [k for k in params if not hasattr(args, k)]
        if unknown:
            raise DPConfigError(f"hyperparameter_search: hp_space returns {unknown}, which are not DPTrainingArguments "
                                f"fields (nor '{SCOPE_KEY}').")
        for key, value in params.items():
            setattr(args, key, value)
        validate_dp_fields(args)
        if self.tuning_data == "private":
            self._note_schedule_choices(trial, params)
        self.records.append({"trial": trial.number, "_set": list(params), "params": params})
        return {}

    def _note_schedule_choices(self, trial, params: dict) -> None:
        from optuna.distributions import CategoricalDistribution

        for key in SCHEDULE_KEYS:
            if key not in params:
                continue
            dist = trial.distributions.get(key)
            if not isinstance(dist, CategoricalDistribution):
                raise DPConfigError(f"hyperparameter_search(tuning_data='private'): '{key}' sets the privacy schedule, "
                                    "so the search cost is bounded over every value it can take; suggest it with "
                                    "trial.suggest_categorical (a finite set), not a continuous range.")
            self.schedule_choices[key] = sorted(set(self.schedule_choices.get(key, [])) | set(dist.choices),
                                                key=repr)

    def record_run(self, trainer, state: str) -> None:
        """After a trial's train(): its planned and spent ε, σ and schedule."""
        if not self.records or trainer.ledger is None:
            return
        led, plan = trainer.ledger, trainer.ledger.plan
        self.records[-1].update(
            state=state, epsilon_planned=plan.planned_epsilon(), epsilon_spent=led.epsilon(),
            sigma=" / ".join(f"{p.noise_multiplier:.4f}" for p in plan.phases),
            sample_rate=" / ".join(f"{p.sample_rate:.4f}" for p in plan.phases),
            steps=" / ".join(str(p.steps) for p in plan.phases), scope=trainer.describe_scope(),
            epsilon_trial_rdp=single_run_epsilon(rdp_curve(led.history, neighboring=plan.neighboring),
                                                 plan.target_delta))

    # ---- the whole search -----------------------------------------------------------------------------
    def worst_curve(self, dataset_size: int, neighboring: str):
        """The pointwise largest RDP curve (for `neighboring` neighbours) over every schedule the space can draw
        (the cartesian product of the categorical choices seen for the schedule keys, the baseline for the rest)."""
        import numpy as np

        keys = sorted(self.schedule_choices)
        worst = None
        for values in itertools.product(*(self.schedule_choices[k] for k in keys)):
            if values not in self._plans:
                args = copy.deepcopy(self.baseline)
                for k, v in zip(keys, values):
                    setattr(args, k, v)
                try:
                    self._plans[values] = plan_run(args, dataset_size)
                except ValueError:
                    self._plans[values] = None  # a combination that cannot run releases nothing
            if (plan := self._plans[values]) is not None:
                curve = rdp_curve([(p.noise_multiplier, p.sample_rate, p.steps) for p in plan.phases],
                                  neighboring=neighboring)
                worst = curve if worst is None else np.maximum(worst, curve)
        return worst

    def total_epsilon(self, dataset_size: int, neighboring: str | None = None) -> float | None:
        """ε of the whole search (mode "private"), for the plan's neighbouring relation or `neighboring`."""
        if self.tuning_data != "private":
            return None
        curve = self.worst_curve(dataset_size, neighboring or self.baseline.neighboring)
        return None if curve is None else search_epsilon(curve, self.trial_count, self.baseline.target_delta)

    def record(self, dataset_size: int, total: float) -> dict:
        """What the best trial's card states (`hp_search.json`): the whole search's ε, for the plan's relation and
        for replace-one neighbours (the relation that holds for a release that states n)."""
        relation = self.baseline.neighboring
        ro = total if relation == "replace_one" else self.total_epsilon(dataset_size, "replace_one")
        return {"tuning_data": "private", "trial_count": self.trial_count.describe(),
                "delta": self.baseline.target_delta, "neighboring": relation, "epsilon": total,
                "epsilon_replace_one": ro}


def run_search(trainer, hp_space=None, compute_objective=None, n_trials: int | None = None,
               direction: str = "minimize", hp_name=None, tuning_data: str | None = None,
               trial_count: TrialCount | None = None, eval_data_public: bool = False, keep_best_model: bool = True,
               **study_kwargs) -> BestRun | None:
    """The body of `DPTrainer.hyperparameter_search` (see the module docstring)."""
    import optuna

    args = trainer.args
    _check_request(trainer, n_trials, direction, tuning_data, trial_count, eval_data_public, study_kwargs)
    data_key = check_search_data(trainer.train_dataset, tuning_data)
    units = trainer._read_units(trainer.train_dataset, args)  # with a privacy_unit, the bound counts units
    n = len(trainer.train_dataset) if units is None else units
    if hp_space is None:
        from ..scope.blocks import find_block_stack

        depth = len(find_block_stack(trainer.call_model_init())[1])
        hp_space = lambda trial: default_dp_hp_space(trial, depth, n)  # noqa: E731
    search = DPSearch(trainer, hp_space, tuning_data, trial_count)
    private = tuning_data == "private"
    if private:
        # The bound covers every schedule the space can draw, not only those drawn: probe the space (data-free)
        # so that conditional schedule keys are seen too.
        probe = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=secrets.randbits(32)))
        for _ in range(64):
            trial = probe.ask()
            search._note_schedule_choices(trial, dict(hp_space(trial)))
        n_trials = trial_count.sample()  # secret randomness: OS entropy, never args.seed
        study_kwargs["sampler"] = optuna.samplers.RandomSampler(seed=secrets.randbits(32))
        study_kwargs["pruner"] = optuna.pruners.NopPruner()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # its log line for each trial prints the private score
        logger.warning(f"hyperparameter_search on PRIVATE data: the number of trials was drawn from "
                       f"{trial_count.describe()} with OS-entropy randomness; hyperparameters from a RandomSampler "
                       "on a secret seed, no pruning; only the best trial is released.")
    else:
        study_kwargs.setdefault("sampler", optuna.samplers.TPESampler(seed=args.seed))
        logger.warning(f"hyperparameter_search on {tuning_data.upper()} data (tuning_data={tuning_data!r}): the "
                       "trials' training set is assumed NOT to be the private set the final model protects, so the "
                       "search is not charged to its budget. Use tuning_data='private' to tune on private data.")
    before = dict(trainer.__dict__)  # put back after the search: nothing of a trial stays on the trainer
    trainer.hp_search_backend = HPSearchBackend.OPTUNA
    trainer.hp_space, trainer.hp_name = search.space, hp_name
    trainer.compute_objective = compute_objective or default_compute_objective
    trainer.run_hooks = [*trainer.run_hooks, search.record_run]  # a new list: `before` keeps the old one
    best = {"value": None, "record": None}
    sign = 1 if direction == "maximize" else -1

    def objective(trial):
        trainer.objective = None
        trainer.train(trial=trial)
        if getattr(trainer, "objective", None) is None:
            trainer.objective = trainer.compute_objective(trainer.evaluate())
        if best["value"] is None or sign * trainer.objective > sign * best["value"]:
            best["value"] = trainer.objective
            best["record"] = trial_record(trainer) if keep_best_model else None
        return trainer.objective

    study = optuna.create_study(direction=direction, **study_kwargs)
    try:
        if n_trials:
            study.optimize(objective, n_trials=n_trials)
    except BaseException:
        end_search(trainer, before, None, (data_key, tuning_data))
        raise
    finally:
        args.__dict__.update(copy.deepcopy(search.baseline).__dict__)
    total = search.total_epsilon(n)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best_trial = study.best_trial if done else None
    write_table(args.output_dir, search, study, best_trial, total)
    announce(search, total, best_trial, args.target_epsilon)
    end_search(trainer, before, best["record"] if best_trial is not None else None, (data_key, tuning_data))
    if best_trial is None:
        logger.warning("hyperparameter_search: no trial completed (K = 0 was drawn, or every trial failed); "
                       "nothing is released.")
        return None
    if best["record"] is not None:
        trainer._search_record = search.record(n, total) if private else None
        trainer.save_model(os.path.join(args.output_dir, "best_trial"))
    # With private data the best trial's index would bound the secret number of trials: it is not returned.
    return BestRun("best" if private else str(best_trial.number), best_trial.value, best_trial.params)


def _check_request(trainer, n_trials, direction, tuning_data, trial_count, eval_data_public, study_kwargs) -> None:
    args = trainer.args
    if tuning_data not in TUNING_DATA:
        raise DPConfigError(f"hyperparameter_search: tuning_data={tuning_data!r}; use one of {TUNING_DATA} ('public' "
                            "or 'held_out': the trials do not train on the private set; 'private': accounted).")
    if trainer.model_init is None:
        raise DPConfigError("hyperparameter_search: pass model_init= to DPTrainer (each trial needs a fresh model).")
    if args.target_epsilon is None:
        raise DPConfigError("hyperparameter_search needs target_epsilon (each trial's σ is calibrated so that it "
                            "spends exactly that ε); with a fixed noise_multiplier each trial would spend another ε.")
    if direction not in ("minimize", "maximize"):
        raise DPConfigError(f"hyperparameter_search: direction={direction!r}; one objective, 'minimize' or 'maximize'.")
    if tuning_data != "private":
        if trial_count is not None:
            raise DPConfigError("hyperparameter_search: trial_count is for tuning_data='private' (a random number of "
                                "trials, accounted); with public or held-out data give n_trials.")
        if not n_trials or n_trials < 1:
            raise DPConfigError(f"hyperparameter_search: n_trials={n_trials}; give the number of trials (>= 1).")
        return
    if n_trials is not None:
        raise DPConfigError("hyperparameter_search(tuning_data='private'): the number of trials must be random and "
                            "secret for the Papernot-Steinke bound; give trial_count=TrialCount.geometric(γ) (or "
                            ".negative_binomial / .logarithmic / .poisson) instead of n_trials.")
    if not isinstance(trial_count, TrialCount):
        raise DPConfigError("hyperparameter_search(tuning_data='private') needs trial_count=TrialCount.geometric(γ), "
                            "e.g. γ = 0.1 for 10 trials on average.")
    if not eval_data_public:
        raise DPConfigError("hyperparameter_search(tuning_data='private'): each trial is scored on eval_dataset "
                            "outside DP-SGD; the Papernot-Steinke bound covers the selection only if that data is "
                            "public. Pass a public validation set as eval_dataset and state eval_data_public=True.")
    if args.report_to:
        raise DPConfigError(f"hyperparameter_search(tuning_data='private'): report_to={args.report_to} would send "
                            "every trial's logs (and so the secret number of trials) to a tracker; set "
                            "report_to='none'.")
    if any(k in study_kwargs for k in ("sampler", "pruner")):
        raise DPConfigError("hyperparameter_search(tuning_data='private'): the sampler and pruner are fixed (random "
                            "hyperparameters from a secret seed, no pruning): an adaptive sampler or a pruner makes "
                            "one trial depend on the private results of others, which the bound does not cover.")
    if args.save_strategy != "no" or args.push_to_hub:
        raise DPConfigError("hyperparameter_search(tuning_data='private'): only the best trial may be released; set "
                            "save_strategy='no' and push_to_hub=False (the best trial goes to output_dir/best_trial).")
    if args.noise_seed is not None:
        logger.warning("hyperparameter_search: noise_seed is set, so no trial is private (testing only).")
