"""Stage 5, training: DP-SGD inside `transformers.Trainer`. `DPTrainer` (`trainer`: DP-SGD by its
`privacy.engine.DPEngine`; features cached from frozen weights in `cached_features`, the ledger and ε it reports in
`privacy_report`; the private Trainer members it relies on in `hf_compat`), `DPTrainingArguments` (`arguments`: its
checks in `arguments.checks`, every Trainer field decided in `arguments.fields`), the privacy plan made from them
(`plan`), the data and evaluation sets checked before any work (`data_checks`, `eval_overlap`), checkpoints written,
restored exactly or refused (`checkpoints`), the hyperparameter search (`hp_search`), and public → private continual
training (`continual`). It uses data, scope, privacy and hub; the later stages (analysis, audit, tuning) use it, and
it imports none of them.
"""

TRAINER_LOGGER = "hf_dp_repr.trainer"  # DPTrainer's logger: every part of the trainer logs to it (users filter on it)
