"""Sampling a synthetic dataset from a DP causal LM, prompted by control codes only.

Post-processing: whatever the sampling does (its seed included) cannot weaken the model's (ε, δ), so the seed
argument needs no secrecy; it makes the sample reproducible.

Example:
    >>> from hf_dp_repr.data.tokenizer import train_tokenizer
    >>> from hf_dp_repr.tiny import tiny_gpt2
    >>> tok = train_tokenizer(["json: Decode a document.", "csv: Read rows."] * 10, vocab_size=300)
    >>> model = tiny_gpt2(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    >>> ds = generate_synthetic(model, tok, ["json", "csv"], 3, max_new_tokens=8, progress=False)
    >>> ds.num_rows, ds.features["labels"].names, list(ds["labels"])
    (6, ['json', 'csv'], [0, 0, 0, 1, 1, 1])
"""

from __future__ import annotations

from datasets import ClassLabel, Dataset, Features, Value

from ..data.control_codes import control_prompt
from ..errors import ArgumentError


def generate_synthetic(model, tokenizer, label_names: list[str], n_per_label: int, *, temperature: float = 1.0,
                       top_p: float = 1.0, max_new_tokens: int = 64, batch_size: int = 32, seed: int = 0,
                       progress: bool = True) -> Dataset:
    """`n_per_label` rows for each label: the model's continuation of `control_prompt(label)`, sampled with
    `temperature` and nucleus `top_p`, at most `max_new_tokens` tokens, in batches of `batch_size`. Columns: `text`
    and `labels` (ClassLabel named `label_names`). The only inputs are the model and the label names."""
    import torch
    from tqdm.auto import tqdm
    from transformers import set_seed

    if n_per_label < 1 or batch_size < 1 or max_new_tokens < 1 or not temperature > 0 or not 0 < top_p <= 1:
        raise ArgumentError(f"generate_synthetic: need n_per_label, batch_size, max_new_tokens ≥ 1, temperature > 0 "
                            f"and 0 < top_p ≤ 1; got {n_per_label}, {batch_size}, {max_new_tokens}, {temperature}, "
                            f"{top_p}")
    set_seed(seed)
    start = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    jobs = [(y, min(batch_size, n_per_label - lo)) for y in range(len(label_names))
            for lo in range(0, n_per_label, batch_size)]
    texts, labels = [], []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for y, n in tqdm(jobs, desc="generating synthetic rows", disable=not progress):
            prompt = start + tokenizer(control_prompt(label_names[y]), add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt] * n, device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
            texts += [t.strip() for t in tokenizer.batch_decode(out[:, len(prompt):], skip_special_tokens=True)]
            labels += [y] * n
    model.train(was_training)
    features = Features({"text": Value("string"), "labels": ClassLabel(names=list(label_names))})
    return Dataset.from_dict({"text": texts, "labels": labels}, features=features)
