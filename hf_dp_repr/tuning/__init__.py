"""Stage 7, tuning: choosing hyperparameters under DP, and what the choice costs. The trainer's hyperparameter
search on Optuna (`search`: every trial spends exactly the target ε; on private data the search's own cost is
accounted), the Papernot–Steinke bound on a random number of trials (`selection_privacy`), and the linear-probe /
fine-tune budget split (`budget_split`). It uses the trainer and attaches to it without the trainer importing it:
`DPTrainer.hyperparameter_search` runs the backend registered as "optuna" (`hf_dp_repr.training.hp_search.backends`).
"""
