"""`DPTrainer.hyperparameter_search`: the Trainer's Optuna search under DP (a mixin placed before `Trainer`; the
search itself is `hf_dp_repr.tuning.search`)."""

from __future__ import annotations

from .head_init import init_head
from .privacy.validation import check_model_is_privatizable
from .scope import phase_scopes


class DPSearchMixin:
    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int | None = None,
                              direction: str = "minimize", backend="optuna", hp_name=None, tuning_data: str = "public",
                              trial_count=None, eval_data_public: bool = False, keep_best_model: bool = True,
                              **kwargs):
        """The Trainer's Optuna search under DP: every trial spends exactly the target (ε, δ) and the search states
        its own cost. `tuning_data`: "public"/"held_out" (default "public": the trials do not train on the private
        set) or "private" (accounted with Papernot & Steinke; needs `trial_count`, a `TrialCount`, and a public
        `eval_dataset`, stated with `eval_data_public=True`). `hp_space` returns DPTrainingArguments fields and
        optionally `trainable_scope` ("all", "blocks:k" or a trainable_groups spec). See `hf_dp_repr.tuning.search`.
        """
        if str(getattr(backend, "value", backend)) != "optuna":
            raise ValueError(f"DPTrainer.hyperparameter_search: backend={backend!r}; only 'optuna' is supported under "
                             "DP (each trial's privacy plan is set up through it).")
        from .tuning.search import run_search

        return run_search(self, hp_space, compute_objective, n_trials, direction, hp_name, tuning_data, trial_count,
                          eval_data_public, keep_best_model, **kwargs)

    def _hp_search_setup(self, trial) -> None:
        super()._hp_search_setup(trial)
        if self.model_init is not None:  # a fresh model (and maybe a new scope): what trains is decided again
            check_model_is_privatizable(self.model)
            init_head(self.model, self.args.head_init)  # the trial's (call_model_init ran before its arguments)
            self._scopes = phase_scopes(self.model, self.args.trainable_blocks, self.args.lp_steps,
                                        self.args.block_stack, self.args.trainable_groups)
            if self._scopes:
                self._scopes[-1].apply(self.model)
            self._dp_optimizer = None
