"""The privacy cost of a search on private data (Papernot & Steinke 2022), checked against hand computations."""

import math

import numpy as np
import pytest

from hf_dp_repr.tuning.selection_privacy import (
    ORDERS,
    TrialCount,
    rdp_curve,
    search_epsilon,
    selection_rdp,
    single_run_epsilon,
)

# A Gaussian mechanism with ε(λ) = ρ λ (ρ = 1/(2σ²)) has an RDP curve known in closed form.


def test_geometric_trial_count_matches_theorem_2_by_hand():
    # ρ = 0.05, η = 1, γ = 0.1, λ = 10, λ̂ = 7:
    #   ε(10) = 0.5; (1+η)(1-1/λ̂)ε(λ̂) = 2·(6/7)·0.35 = 0.6; (1+η)log(1/γ)/λ̂ = 2·ln10/7 = 0.657881;
    #   E[K] = η(1-γ)/(γ(1-γ^η)) = 1/γ = 10, log(E[K])/(λ-1) = ln10/9 = 0.255843  →  ε'(10) = 2.013724
    eps = selection_rdp(np.array([0.5, 0.35]), TrialCount.geometric(0.1), orders=[10.0, 7.0], orders_hat=[7.0])
    assert eps[0] == pytest.approx(2.013724243, rel=1e-9)


def test_logarithmic_trial_count_matches_theorem_2_by_hand():
    # η = 0 (logarithmic), γ = 0.1: E[K] = (1/γ - 1)/log(1/γ) = 9/ln10 = 3.908650;
    #   ε'(10) = 0.5 + (6/7)·0.35 + ln10/7 + ln(3.908650)/9 = 0.5 + 0.3 + 0.328941 + 0.151466 = 1.280407
    count = TrialCount.logarithmic(0.1)
    assert count.expected() == pytest.approx(3.908650337, rel=1e-9)
    eps = selection_rdp(np.array([0.5, 0.35]), count, orders=[10.0, 7.0], orders_hat=[7.0])
    assert eps[0] == pytest.approx(1.280406520, rel=1e-9)


def test_poisson_trial_count_matches_theorem_6_by_hand():
    # ρ = 0.001, μ = 3, λ = 10; δ̂ at ε̂ = log(1 + 1/(λ-1)) = ln(10/9), from the single order 10 (inverse of the
    # Balle et al. conversion): δ̂ = exp(9·(0.01 - ln(10/9) + ln(0.9)) - ln10) = 0.0164230;
    #   ε'(10) = ε(10) + μ δ̂ + ln(μ)/(λ-1) = 0.01 + 0.0492689 + 0.1220680 = 0.1813369
    eps = selection_rdp(np.array([0.01]), TrialCount.poisson(3.0), orders=[10.0], orders_hat=[10.0])
    assert eps[0] == pytest.approx(0.181336939, rel=1e-6)


def test_total_epsilon_converts_with_opacus_conversion_by_hand():
    # Only λ = λ̂ = 10: ε'(10) = 0.5 + 2·0.9·0.5 + 2·ln10/10 + ln10/9 = 2.116360; to (ε, δ = 1e-5) as Opacus
    # (Balle et al. 2020): ε = ε' - (ln δ + ln λ)/(λ-1) + ln((λ-1)/λ) = 2.116360 + 1.023371 - 0.105361 = 3.034370
    total = search_epsilon(np.array([0.5]), TrialCount.geometric(0.1), delta=1e-5, orders=[10.0])
    assert total == pytest.approx(3.034370443, rel=1e-9)


def test_search_costs_more_than_one_run_and_less_than_composing_the_expected_trials():
    curve = rdp_curve([(1.0, 0.05, 200)])
    one = single_run_epsilon(curve, 1e-5)
    total = search_epsilon(curve, TrialCount.geometric(0.25), 1e-5)
    four_composed = single_run_epsilon(4 * curve, 1e-5)
    assert one < total < four_composed


def test_rdp_curve_adds_phases_and_refuses_nothing_silently():
    a, b = rdp_curve([(1.0, 0.1, 10)]), rdp_curve([(2.0, 0.2, 5)])
    assert np.allclose(rdp_curve([(1.0, 0.1, 10), (2.0, 0.2, 5)]), a + b)
    assert np.isinf(rdp_curve([(0.0, 0.1, 10)])).all()  # σ = 0: no privacy, never a finite number
    assert len(a) == len(ORDERS)


def test_trial_counts_are_drawn_from_the_stated_distribution_and_not_from_numpy_global_seed():
    rng = np.random.default_rng(0)
    draws = [TrialCount.geometric(0.25).sample(rng) for _ in range(20000)]
    assert min(draws) >= 1 and np.mean(draws) == pytest.approx(4.0, rel=0.03)
    draws = [TrialCount.negative_binomial(2.0, 0.3).sample(rng) for _ in range(20000)]
    assert min(draws) >= 1 and np.mean(draws) == pytest.approx(TrialCount.negative_binomial(2.0, 0.3).expected(),
                                                               rel=0.03)
    np.random.seed(0)
    first = [TrialCount.geometric(0.1).sample() for _ in range(30)]
    np.random.seed(0)
    assert [TrialCount.geometric(0.1).sample() for _ in range(30)] != first  # OS entropy, not the global seed


def test_bad_distributions_are_refused():
    with pytest.raises(ValueError, match="0 < gamma < 1"):
        TrialCount.geometric(1.5)
    with pytest.raises(ValueError, match="unknown distribution 'uniform'"):
        TrialCount("uniform")
    assert math.isinf(search_epsilon(np.full(len(ORDERS), np.inf), TrialCount.poisson(2.0), 1e-5))


# ---- replace-one neighbours (the default: the ledger and the card publish n) ----------------------------------------
def test_replace_one_rdp_matches_the_closed_form_and_a_quadrature():
    from scipy import integrate, stats

    from hf_dp_repr.tuning.selection_privacy import replace_one_rdp

    orders = np.array([1.5, 2.0, 10.0, 100.0, 512.0])
    # q = 1: N(-1, σ²) against N(1, σ²), D_λ = λ · 2² / (2σ²) at every order (the peak of the integrand is far left)
    for sigma in (0.7, 2.0):
        assert replace_one_rdp(sigma, 1.0, orders) == pytest.approx(2 * orders / sigma**2, rel=1e-6)
    # q < 1: adaptive quadrature of the same integral
    for sigma, q, lam in ((1.0, 0.1, 4.0), (0.8, 0.25, 12.0), (2.0, 0.5, 30.0)):
        def log_mix(x, shift):
            return np.logaddexp(math.log1p(-q) + stats.norm.logpdf(x, 0, sigma),
                                math.log(q) + stats.norm.logpdf(x, shift, sigma))

        value, _ = integrate.quad(lambda x: math.exp(lam * log_mix(x, -1) + (1 - lam) * log_mix(x, 1)),
                                  -2 * lam - 20 * sigma, 20 * sigma, points=[-lam, -1.0, 0.0, 1.0], limit=400)
        assert replace_one_rdp(sigma, q, [lam])[0] == pytest.approx(math.log(value) / (lam - 1), rel=1e-6)


@pytest.mark.parametrize("history,delta", [([(1.83, 0.1, 20)], 1e-5), ([(0.8, 0.25, 4)], 1e-4),
                                           ([(2.37, 0.01, 1000)], 1e-5), ([(0.5, 0.02, 100)], 1e-5),
                                           ([(1.0, 0.1, 10), (2.0, 0.05, 40)], 1e-5)])
def test_replace_one_curve_never_reports_less_than_dp_accounting(history, delta):
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    acc = PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    for sigma, q, steps in history:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    exact = acc.get_epsilon(delta)
    replace = single_run_epsilon(rdp_curve(history, neighboring="replace_one"), delta)
    assert exact <= replace <= 1.3 * exact  # RDP converts to (ε, δ) with some loss, never below
    assert single_run_epsilon(rdp_curve(history), delta) < replace  # add/remove is smaller
