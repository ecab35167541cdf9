"""Golden outputs: what a refactor must not change. The ledger file of a few seeded runs, a summary of
their saved weights, and an ε table (each accountant, one and two phases, both neighbouring relations, and σ
calibrated for a target). The files in tests/golden/ were written by this code before the package was reorganised
(issue 24); a move, the DP engine or a registry that changes one byte of them changes the guarantee or the run.

The weights are summarised per tensor (name, dtype, shape, and three sums: plain, absolute, and weighted by a fixed
cosine pattern), with one torch thread, noise_seed and the Trainer's seed fixed. Numbers are compared to a relative
1e-9 (ledgers, ε table) and 1e-5 (weights): another CPU kind, or a new numpy/scipy, rounds a matmul or an FFT
differently in the last bits (byte-for-byte hashes failed on a machine of the same kind, base code unchanged), while a
change to the guarantee or the run moves these by far more. Regenerate, only on purpose and from code known to be
right: `HF_DP_REPR_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py`.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from hf_dp_repr.privacy.accounting import calibrate_last_phase, calibrate_noise_multiplier, compute_epsilon
from hf_dp_repr.privacy.ledger import LEDGER_FILE
from hf_dp_repr.tiny import tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("HF_DP_REPR_UPDATE_GOLDEN") == "1"

# name: the DP arguments of a 2-3 step run of a tiny ViT on 48 digits rows (batch 8: q = 1/6).
RUNS = {
    "ghost_replace_one": dict(clipping_engine="ghost", target_epsilon=8.0, neighboring="replace_one"),
    "hooks_rdp": dict(clipping_engine="hooks", noise_multiplier=1.0, accountant="rdp", clipping="per_layer"),
    "lp_ft_two_phases": dict(trainable_blocks=1, lp_steps=1, max_steps=3, target_epsilon=4.0,
                             lp_epsilon_fraction=0.25),
    "privacy_unit": dict(privacy_unit="user_id", noise_multiplier=1.2, per_sample_max_grad_norm=2.0),
    "add_remove_pld": dict(target_epsilon=8.0, accountant="pld", neighboring="add_remove", clipping="automatic"),
}


def same(found, golden, rel: float, where: str = "") -> None:
    """Equal structure and strings, numbers within `rel` (relative, with an absolute floor of rel * 1e-3)."""
    if isinstance(golden, dict):
        assert isinstance(found, dict) and sorted(found) == sorted(golden), f"{where}: keys differ"
        for key in golden:
            same(found[key], golden[key], rel, f"{where}/{key}")
    elif isinstance(golden, list):
        assert isinstance(found, list) and len(found) == len(golden), f"{where}: lengths differ"
        for i, (f, g) in enumerate(zip(found, golden)):
            same(f, g, rel, f"{where}[{i}]")
    elif isinstance(golden, float) or (isinstance(found, float) and isinstance(golden, int)):
        assert math.isclose(found, golden, rel_tol=rel, abs_tol=rel * 1e-3), f"{where}: {found} != {golden}"
    else:
        assert found == golden, f"{where}: {found!r} != {golden!r}"


def check_or_write(name: str, found: dict, rel: float) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(found, indent=1) + "\n")
    same(found, json.loads(path.read_text()), rel, name)


def weights_summary(folder: Path) -> dict:
    tensors = load_file(str(folder / "model.safetensors"))
    out = {}
    for name in sorted(tensors):
        t = tensors[name].double().reshape(-1)
        pattern = torch.cos(torch.arange(t.numel(), dtype=torch.float64) * 0.7)
        out[name] = [str(tensors[name].dtype), list(tensors[name].shape), t.sum().item(), t.abs().sum().item(),
                     (t * pattern).sum().item()]
    return out


def train_and_save(name: str, digits, tmp_path) -> Path:
    from hf_dp_repr import DPTrainer, DPTrainingArguments

    kw = dict(RUNS[name])
    data = digits["train"].select(range(48))
    if kw.get("privacy_unit"):
        rows = data.with_format(None).to_dict()
        rows["user_id"] = [f"u{i // 3}" for i in range(48)]  # 16 users of 3 rows
        data = Dataset.from_dict(rows).with_format("torch", columns=["pixel_values", "labels"],
                                                   output_all_columns=True)
    out = tmp_path / name
    args = DPTrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=kw.pop("max_steps", 2),
                               learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                               report_to="none", save_strategy="no", disable_tqdm=True, seed=0, noise_seed=7,
                               target_delta=1e-3, **kw)
    trainer = DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(out))
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_seeded_run_ledger_and_weights_unchanged(name, digits, tmp_path):
    out = train_and_save(name, digits, tmp_path)
    check_or_write(f"{name}.{LEDGER_FILE}", json.loads((out / LEDGER_FILE).read_text()), rel=1e-9)
    check_or_write(f"{name}.weights.json", weights_summary(out), rel=1e-5)


# (label, history [(σ, q, steps), ...], δ)
HISTORIES = [
    ("one_phase", [(1.1, 0.01, 1000)], 1e-5),
    ("one_phase_few_steps", [(0.9, 0.05, 3)], 1e-5),
    ("two_phases", [(2.0, 0.05, 50), (1.0, 0.02, 300)], 1e-5),
    ("full_batch", [(4.0, 1.0, 10)], 1e-3),
]
RELATIONS = {"prv": ["add_remove"], "rdp": ["add_remove"], "pld": ["add_remove", "replace_one"]}
# (target ε, δ, q, steps, accountant, relation), and a last phase after a fixed first one
CALIBRATIONS = [(8.0, 1e-5, 0.01, 1000, "prv", "add_remove"), (1.0, 1e-5, 0.05, 100, "rdp", "add_remove"),
                (8.0, 1e-5, 0.01, 200, "pld", "replace_one"), (2.0, 1e-3, 0.1, 20, "pld", "add_remove")]


def epsilon_table() -> dict:
    table = {"epsilon": {}, "sigma": {}}
    for label, history, delta in HISTORIES:
        for accountant, relations in RELATIONS.items():
            for relation in relations:
                table["epsilon"][f"{label}/{accountant}/{relation}"] = compute_epsilon(history, delta, accountant,
                                                                                       relation)
    for target, delta, q, steps, accountant, relation in CALIBRATIONS:
        key = f"eps={target}/delta={delta}/q={q}/T={steps}/{accountant}/{relation}"
        table["sigma"][key] = calibrate_noise_multiplier(target, delta, q, steps, accountant, relation)
    table["sigma"]["last_phase/prv"] = calibrate_last_phase(1.0, 1e-5, [(3.0, 0.05, 50)], 0.02, 300, "prv")
    table["sigma"]["same_sigma/pld/replace_one"] = calibrate_last_phase(
        4.0, 1e-3, [(0.0, 1 / 6, 1)], 1 / 6, 2, "pld", same_sigma=True, neighboring="replace_one")
    return table


def test_epsilon_table_unchanged():
    check_or_write("epsilon_table.json", epsilon_table(), rel=1e-9)
