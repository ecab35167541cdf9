"""Stage 6, trl: DP-SGD for TRL's trainers, the way language models are fine-tuned today (an optional extra:
`pip install 'hf-dp-repr[trl]'`; nothing below this stage imports `trl`).

- `DPSFTTrainer` / `DPSFTConfig` (`sft`): supervised fine-tuning on conversations or prompt/completion pairs, the
  loss on the assistant's (completion's) tokens, one conversation (or one user) per unit of privacy;
- `DPDPOTrainer` / `DPDPOConfig` (`dpo`): preference optimisation, one pair (prompt, chosen, rejected) per example;
- `dp_trainer_class` / `dp_config_class` (`mechanism`): the one mechanism both are made with, for another Trainer
  subclass whose loss is a sum of per-example terms (TRL trainers other than SFT and DPO are refused);
- `chat_data`: a locally trained chat tokenizer and conversations built from text that ships, for offline runs.

The names load on first use, so `import hf_dp_repr.trl` costs nothing until one is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util

REQUIRED_TRL = "1.16.0"  # setup.cfg's `trl` extra pins it, as transformers is pinned
_LAZY = {"DPSFTTrainer": "sft", "DPSFTConfig": "sft", "DPDPOTrainer": "dpo", "DPDPOConfig": "dpo",
         "dp_trainer_class": "mechanism", "dp_config_class": "mechanism", "check_supported": "mechanism"}


def _require_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        raise ImportError("hf_dp_repr.trl needs TRL, an optional extra: pip install 'hf-dp-repr[trl]' "
                          f"(trl=={REQUIRED_TRL}).")


def __getattr__(name: str):
    if name in _LAZY:
        _require_trl()
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
