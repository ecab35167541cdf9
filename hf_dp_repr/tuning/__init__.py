"""Tuning under DP: hyperparameter search with its own privacy cost (`search`, `selection_privacy`)."""
