"""The card of a DP synthetic dataset (`hf_dp_repr.synth`): the guarantee it inherits from the model that sampled
it (ε, δ, the unit, the model's ledger) and how it was made. Its ε is the DP model card's headline ε, computed
from the same ledger by the same code (`card_values.template_values`), never typed in.

Example (a ledger as `PrivacyLedger.to_dict()` writes it; ε computed by the accountant):
    >>> from hf_dp_repr.privacy.accounting import compute_epsilon
    >>> led = dict(accountant="pld", neighboring="replace_one", target_delta=1e-5, per_sample_max_grad_norm=1.0,
    ...     clipping="flat", dataset_size=6400, poisson_sampling=True, target_epsilon=3.0, planned_steps=100,
    ...     steps_done=100, phases=[dict(name="train", noise_multiplier=1.1, sample_rate=0.01, steps=100,
    ...     expected_batch_size=64)], history=[(1.1, 0.01, 100)],
    ...     epsilon=compute_epsilon([(1.1, 0.01, 100)], 1e-5, "pld", "replace_one"))
    >>> card = dataset_card(led, {"model": "tiny_gpt2", "label_names": ["json"], "n_per_label": 2, "rows": 2})
    >>> card.data.to_dict()["hf_dp_repr"]["epsilon"] == led["epsilon"], "synthetic" in card.data.tags
    (True, True)
"""

from __future__ import annotations

from huggingface_hub import DatasetCard, DatasetCardData

from .card_values import _release_claim, template_values

DATA_FILE = "synthetic.parquet"
TAGS = ["synthetic", "differential-privacy", "dp-sgd", "hf-dp-repr"]


def headline_epsilon(ledger: dict) -> float | None:
    """The ε the model card states for this ledger (None: not private)."""
    private = all((p.get("noise_multiplier") or 0) > 0 for p in ledger.get("phases") or [ledger])
    if not private or ledger.get("epsilon") is None:
        return None
    return _release_claim(ledger, ledger.get("history", []), ledger.get("neighboring", "add_remove"), None)["epsilon"]


def dataset_card(ledger: dict, synthesis: dict) -> DatasetCard:
    """The card of a synthetic dataset sampled from the DP model whose ledger is `ledger`; `synthesis`: how it was
    sampled (model, label_names, n_per_label, rows, temperature, top_p, max_new_tokens, seed, private_data)."""
    values = template_values(ledger, {}, "", None, None)
    eps = headline_epsilon(ledger)
    codes = ", ".join(f"`{c}`" for c in synthesis["label_names"])
    sampling = ", ".join(f"{k} = {synthesis[k]}" for k in ("temperature", "top_p", "max_new_tokens", "seed")
                         if k in synthesis)
    guarantee = (f"{values['summary']} The private training set had {ledger['dataset_size']} {values['units_word']}; "
                 f"the guarantee protects {values['unit_text']}." if eps is not None else
                 "**Not differentially private**: the model was a non-private reference (noise_multiplier = 0).")
    body = f"""# DP synthetic text ({synthesis['rows']} rows)

Sampled from a causal language model fine-tuned with DP-SGD (hf-dp-repr) on private labelled text, following
Yue et al. 2023 ("Synthetic text generation with differential privacy: a simple and practical recipe").

## Privacy guarantee

{guarantee}

Sampling is post-processing of the DP model: the rows carry the model's guarantee, whatever they contain. ε was
computed by the {ledger.get('accountant')} accountant from the executed DP-SGD history of the model, whose ledger
is `privacy_ledger.json` in this repository (σ = {values['sigma_text']}, {values['sampling_text']},
clipping norm C = {values['clip_norm']}, {values['steps_done']} steps).

## How it was made

1. Each private row was written as `<label>: <text>` (its control code first) and the model
   ({synthesis['model']}) was fine-tuned on these rows with DP-SGD. Private data: {synthesis.get('private_data',
   'not described')}.
2. For each label ({codes}), {synthesis['n_per_label']} rows were sampled from the DP model, prompted by
   `<label>:` alone: the prompts are built from the public label names, never from a private row.
   Sampling: {sampling}. The seed only makes the sample reproducible (post-processing needs no secret).

Columns: `text` (the generated continuation) and `labels` (the control code it was prompted with).
The rows are model output: they can be wrong, repetitive or off-topic, and they are not real records.
"""
    data = DatasetCardData(
        tags=TAGS if eps is not None else ["synthetic", "hf-dp-repr"], task_categories=["text-classification"],
        configs=[{"config_name": "default", "data_files": [{"split": "train", "path": DATA_FILE}]}],
        hf_dp_repr={"epsilon": eps, "delta": ledger.get("target_delta"), "privacy_unit": ledger.get("privacy_unit",
                                                                                                     "row"),
                    "accountant": ledger.get("accountant"), "neighboring": ledger.get("neighboring")})
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n\n{body}")
