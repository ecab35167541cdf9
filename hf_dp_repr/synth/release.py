"""A synthetic dataset saved for release: its rows, the card that states the guarantee it inherits, the ledger of
the model that sampled it and the record of how it was sampled (push it with `hf_dp_repr.hub.dataset_push`).

Example: see `tests/test_synth.py`; loading a saved folder back: `datasets.Dataset.from_parquet(folder +
"/synthetic.parquet")` (the ClassLabel names are kept in the file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..data.control_codes import control_prompt
from ..errors import LedgerError
from ..hub.card import CARD_FILE
from ..hub.dataset_card import DATA_FILE, dataset_card
from ..hub.dataset_push import SYNTHESIS_FILE
from ..privacy.ledger import LEDGER_FILE


def save_synthetic(dataset, folder: str | os.PathLike, ledger: dict, synthesis: dict) -> Path:
    """Write `dataset` (from `generate_synthetic`) to `folder` with its card, `ledger` (the DP model's
    `PrivacyLedger.to_dict()`, copied as privacy_ledger.json) and `synthesis.json` (how it was sampled: `synthesis`
    plus the label names, the prompts, which are the control codes, and the row count). Returns the folder."""
    if not ledger or ledger.get("epsilon", "missing") == "missing":
        raise LedgerError("save_synthetic: the ledger of the DP model that sampled the rows is required; train with "
                          "DPTrainer and pass trainer.ledger.to_dict().")
    names = dataset.features["labels"].names
    record = {**synthesis, "label_names": names, "prompts": [control_prompt(n) for n in names],
              "n_per_label": synthesis.get("n_per_label"), "rows": dataset.num_rows}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dataset.to_parquet(str(folder / DATA_FILE))
    (folder / LEDGER_FILE).write_text(json.dumps(ledger, indent=2, default=str))
    (folder / SYNTHESIS_FILE).write_text(json.dumps(record, indent=2))
    dataset_card(ledger, record).save(folder / CARD_FILE)
    return folder
