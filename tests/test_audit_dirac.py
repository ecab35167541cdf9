"""White-box gradient ("Dirac") canaries through the real DPTrainer: the one-run audit detects noise switched off
and clipping switched off (which the input-space canary audit misses), and stays below the claim of a DP run.

Each run: a 1-block ViT of width 16, 64 digits + the included of M = 64 canaries, 20 steps of batch 32 (under a
second to a few seconds). The inclusion draw and the noise are seeded here (not secret) so the runs repeat."""

import numpy as np
import pytest
import torch

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.audit.bounds import one_run_epsilon_lower_bound
from hf_dp_repr.audit.dirac import CANARY_COLUMN, train_with_dirac_canaries, with_dirac_canaries
from hf_dp_repr.privacy.optimizer import MicroBatchDPOptimizer
from hf_dp_repr.tiny import tiny_vit

M, K, STEPS, BATCH = 64, 16, 20, 32
MAX_BOUND = one_run_epsilon_lower_bound(M, 2 * K, 2 * K, 1e-5)  # every guess right: 2.32, the most M = 64 can show
EPS_1 = dict(noise_multiplier=5.95, accountant="prv")  # ε = 0.9995 (prv): the σ that target_epsilon=1 finds, no search


def _args(tmp_path, **budget):
    budget.setdefault("neighboring", "add_remove")  # canaries added or left out test an add/remove claim
    return DPTrainingArguments(output_dir=str(tmp_path), target_delta=1e-5, noise_seed=0,
                               per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
                               report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
                               **budget)


def _audit(digits, args):
    model = tiny_vit(hidden_size=16, num_hidden_layers=1, intermediate_size=32)
    out = train_with_dirac_canaries(model, args, digits["train"].select(range(64)), M, k=K, inclusion_seed=3)
    print({k: v for k, v in out.items() if k not in ("trainer_obj", "scores")})
    return out


def _included(out) -> np.ndarray:
    rows = out["trainer_obj"].train_dataset.with_format("numpy")[CANARY_COLUMN]
    return np.isin(np.arange(M), np.asarray(rows))


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_noise_off_reads_exactly_one_clipped_contribution_per_sampled_step(digits, tmp_path, engine):
    out = _audit(digits, _args(tmp_path, noise_multiplier=0.0, clipping_engine=engine))
    scores, included = out["scores"], _included(out)
    # in units of C: a canary's gradient of norm 1000·C adds exactly C each step that samples it, else nothing
    assert np.allclose(scores, np.round(scores), atol=1e-3) and np.all(scores[~included] == 0)
    assert np.all(scores[included] >= 1) and scores[included].max() < STEPS + 1
    assert out["correct"] == out["guesses"] == 2 * K and out["claimed_epsilon"] is None
    assert out["epsilon_lower_bound"] == pytest.approx(MAX_BOUND) and MAX_BOUND > 2


def test_dp_run_at_epsilon_1_stays_below_its_claim(digits, tmp_path):
    out = _audit(digits, _args(tmp_path, **EPS_1))
    assert 0.99 <= out["claimed_epsilon"] <= 1.0
    assert out["epsilon_lower_bound"] <= out["claimed_epsilon"]


def test_clipping_switched_off_is_detected_while_the_ledger_claims_epsilon_1(digits, tmp_path, monkeypatch):
    """A bug that skips clipping but still adds the noise calibrated to C: the ledger says ε = 1, the input-space
    canaries saw nothing (issue 22: 24 of 40 right, ε ≥ 0), the Dirac canaries see every unclipped gradient."""
    monkeypatch.setattr(MicroBatchDPOptimizer, "clip_factors", lambda self, norms: torch.ones_like(norms))
    out = _audit(digits, _args(tmp_path, **EPS_1))
    assert 0.99 <= out["claimed_epsilon"] <= 1.0
    assert out["correct"] == out["guesses"]
    assert out["epsilon_lower_bound"] == pytest.approx(MAX_BOUND) and out["epsilon_lower_bound"] > 2 * 1.0
    included = _included(out)
    assert out["scores"][included].min() > 500  # ~1000 per sampled step: the unclipped B = 1000·C


def test_unclipped_reference_is_measured_unclipped(digits, tmp_path):
    out = _audit(digits, _args(tmp_path, noise_multiplier=0.0, clipping="none"))
    scores, included = out["scores"], _included(out)
    assert np.allclose(scores / 1000, np.round(scores / 1000), atol=1e-3) and scores[included].min() >= 1000
    assert out["epsilon_lower_bound"] == pytest.approx(MAX_BOUND)


def test_canary_rows_and_refusals(digits, tmp_path):
    train = digits["train"].select(range(8))
    data = with_dirac_canaries(train, np.array([True, False, True]))
    assert [int(c) for c in data[CANARY_COLUMN]] == [-1] * 8 + [0, 2] and len(data) == 10
    with pytest.raises(ValueError, match="already has"):
        with_dirac_canaries(data, np.array([True]))
    model = tiny_vit(hidden_size=16, num_hidden_layers=1, intermediate_size=32)
    replace = _args(tmp_path / "r", target_epsilon=1.0, accountant="pld", neighboring="replace_one")
    with pytest.raises(ValueError, match="neighboring='add_remove'"):
        train_with_dirac_canaries(model, replace, train, 8, k=2)
    with pytest.raises(ValueError, match="2k <= m"):
        train_with_dirac_canaries(model, _args(tmp_path / "k", target_epsilon=1.0), train, 8, k=5)
    assert not (tmp_path / "r").exists() and not (tmp_path / "k").exists()  # refused before training
