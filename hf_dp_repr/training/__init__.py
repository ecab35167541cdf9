"""Stage 5, training: DP-SGD inside `transformers.Trainer`. `DPTrainer` (`trainer`: DP-SGD by its
`privacy.engine.DPEngine`; what it adds to the Trainer's features, reports, saving and search in `features`,
`report`, `saving`, `search`; the private Trainer members it relies on in `hf_compat`),
`DPTrainingArguments` (`arguments`, its checks in `argument_checks`, every Trainer field decided in
`argument_fields`), the privacy plan made from them (`plan`), the data and evaluation sets checked before any work
(`data_checks`, `eval_overlap`), checkpoints restored exactly or refused (`checkpoint`, `output_dir`, `resume`), and
public → private continual training (`continual`, `curvature`). It uses data, scope, privacy and hub; the later
stages (analysis, audit, tuning) use it, and it imports none of them.
"""

TRAINER_LOGGER = "hf_dp_repr.trainer"  # DPTrainer's logger: every part of the trainer logs to it (users filter on it)
