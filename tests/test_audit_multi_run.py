"""Classic multi-run audit: threshold chosen on calibration runs, Clopper–Pearson bound on the counted runs."""

import numpy as np
import pytest

from hf_dp_repr.audit.multi_run import audit_from_losses, best_threshold, multi_run_audit


def test_threshold_and_counts():
    assert best_threshold(np.array([0.1, 0.2, 0.3]), np.array([1.0, 2.0, 3.0])) == pytest.approx(0.65)
    # 20/20 runs with the canary below the threshold, 0/20 without: the hand-worked value of test_audit_bounds
    out = audit_from_losses(np.full(20, 0.1), np.full(20, 3.0), threshold=1.0, delta=0.0)
    assert (out["tpr"], out["fpr"]) == (1.0, 0.0)
    assert out["epsilon_lower_bound"] == pytest.approx(1.59677, abs=1e-4)
    # a threshold that separates nothing proves nothing
    assert audit_from_losses(np.full(20, 0.1), np.full(20, 0.1), 1.0, 0.0)["epsilon_lower_bound"] == 0.0


def test_multi_run_audit_uses_calibration_runs_for_the_threshold_only():
    calls = []

    def fake(include):  # the first 2 runs each way (calibration) separate at 1.0; the counted ones at 10
        calls.append(include)
        n = len(calls)
        return (0.0 if include else 2.0) if n <= 4 else (5.0 if include else 20.0)

    out = multi_run_audit(fake, runs=10, calibration_runs=2, delta=0.0)
    assert len(calls) == 24 and out["threshold"] == pytest.approx(1.0)
    assert out["tpr"] == 0.0 and out["epsilon_lower_bound"] == 0.0  # counted runs all above the threshold


@pytest.mark.slow
def test_multi_run_on_digits_non_private_control(digits):
    """The non-private control memorises one OOD canary: the multi-run bound is positive (10 + 10 counted runs,
    2 + 2 calibration runs: all 10 + 10 on the right side of the threshold give ε ≥ 0.81, 9 of 10 still 0.59; a canary
    that was not memorised, or not inserted, gives about 0). Each run is 100 full-batch AdamW steps on 20 rows (lr 1e-2
    decaying linearly, gradient norm clipped to 1: a Trainer's defaults, in a plain loop, 24 Trainer runs took 50 s).
    The seeds are fixed: with other seeds, an audit of 3 + 3 calibration runs separates a single canary this well in
    about half of the draws."""
    import torch

    from hf_dp_repr.audit.canaries import make_canaries, with_canaries
    from hf_dp_repr.audit.mia import classification_losses
    from hf_dp_repr.tiny import tiny_vit

    train = digits["train"].select(range(20))
    canary = make_canaries(digits["test"], 1, "ood", seed=2)
    seeds = iter(range(1000))

    def train_and_score(include):
        model = tiny_vit(seed=next(seeds), hidden_size=32, num_hidden_layers=2, intermediate_size=64)
        rows = with_canaries(train, canary, np.array([include]))[:]
        x, y = rows["pixel_values"], rows["labels"]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / 100)
        model.train()
        for _ in range(100):
            model(pixel_values=x, labels=y).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            schedule.step()
            opt.zero_grad()
        return float(classification_losses(model, canary)[0])

    out = multi_run_audit(train_and_score, runs=10, calibration_runs=2, delta=1e-5)
    print(out)
    assert out["tpr"] >= 0.9 and out["fpr"] <= 0.1
    assert out["epsilon_lower_bound"] > 0.5
