"""DP synthetic text (Yue et al. 2023, "Synthetic text generation with differential privacy: a simple and practical
recipe"): fine-tune a causal LM with DP-SGD on private labelled text, each row prefixed by its control code (the
label), then sample rows from the DP model, prompted by the control codes alone. Sampling is post-processing of the
DP model, so the synthetic dataset carries the model's (ε, δ) and may be shared.

- `hf_dp_repr.data.control_codes`: the training rows ("logging: text…") and the prompts ("logging:"), built
  from the public label names only;
- `generate`: batched sampling (temperature, top-p, length) with a progress bar → a `datasets.Dataset`;
- `release`: the dataset saved with its card (ε, δ, unit, the model's ledger, how it was made), and its push to a
  dataset repository through the allow-list of `hf_dp_repr.hub.dataset_push`.

The recipe (`hf-dp-repr synth`, `recipes/dp_synthetic_text.py`): `hf_dp_repr.scripts.synth`.
"""

from ..data.control_codes import CONTROL_FORMAT, control_prompt, control_rows
from ..hub.dataset_card import dataset_card
from ..hub.dataset_push import SYNTHESIS_FILE
from .generate import generate_synthetic
from .release import save_synthetic

__all__ = ["CONTROL_FORMAT", "SYNTHESIS_FILE", "control_prompt", "control_rows", "dataset_card",
           "generate_synthetic", "save_synthetic"]
