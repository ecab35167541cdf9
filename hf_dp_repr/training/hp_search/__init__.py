"""`DPTrainer.hyperparameter_search` under DP: the registered backends (`backends`), the data a search tuned on
(`tuning_data`) and what the trainer records around a search (`trials`)."""
