"""Checkpoints: what DPTrainer writes (`saving`: weights, ledger, spent record, DP card, staged then committed),
the run folder's layout (`output_dir`), weights restored exactly or refused (`weights`, `sharded` for FSDP2), and
what a resume checks and charges (`resume`)."""
