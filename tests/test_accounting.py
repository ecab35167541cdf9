"""Accounting of multi-phase runs: composition, calibration of the last phase, and no silent under-report."""

import pytest

from hf_dp_repr.privacy.accounting import (
    Phase,
    PrivacyLedger,
    calibrate_last_phase,
    calibrate_noise_multiplier,
    compute_epsilon,
)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_last_phase_calibration_spends_exactly_the_target(accountant):
    sigma1 = calibrate_noise_multiplier(0.3, 1e-5, 0.05, 50, accountant)
    sigma2 = calibrate_last_phase(1.0, 1e-5, [(sigma1, 0.05, 50)], 0.02, 300, accountant)
    eps = compute_epsilon([(sigma1, 0.05, 50), (sigma2, 0.02, 300)], 1e-5, accountant)
    assert 0.999 * 1.0 <= eps <= 1.0
    shared = calibrate_last_phase(1.0, 1e-5, [(0.0, 0.05, 50)], 0.02, 300, accountant, same_sigma=True)
    assert 0.999 <= compute_epsilon([(shared, 0.05, 50), (shared, 0.02, 300)], 1e-5, accountant) <= 1.0


def test_gdp_refuses_to_compose_different_phases():
    # Opacus' GDP accountant reads only the last (σ, q) of its history: composing would under-report.
    with pytest.raises(ValueError, match="'gdp' accountant cannot compose"):
        compute_epsilon([(1.0, 0.05, 50), (2.0, 0.02, 300)], 1e-5, "gdp")
    same = compute_epsilon([(1.0, 0.05, 50), (1.0, 0.05, 30)], 1e-5, "gdp")
    assert same == compute_epsilon([(1.0, 0.05, 80)], 1e-5, "gdp")


def test_ledger_steps_through_its_phases_and_round_trips(tmp_path):
    ledger = PrivacyLedger(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat",
                           dataset_size=100, poisson_sampling=True,
                           phases=[Phase("linear_probe", 2.0, 0.2, 2, 20), Phase("fine_tune", 1.0, 0.1, 3, 10)])
    for _ in range(5):
        ledger.record_step()
    assert ledger.history == [(2.0, 0.2, 2), (1.0, 0.1, 3)]
    by_phase = ledger.epsilon_by_phase()
    assert by_phase["linear_probe"] == compute_epsilon([(2.0, 0.2, 2)], 1e-5, "rdp")
    assert ledger.epsilon() == compute_epsilon(ledger.history, 1e-5, "rdp") < sum(by_phase.values())
    ledger.save(tmp_path)
    assert PrivacyLedger.load(tmp_path) == ledger
