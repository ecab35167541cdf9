"""The ε lower bounds of hf_dp_repr.audit.bounds against values worked out by hand from the papers' formulas."""

import math

import pytest

from hf_dp_repr.audit.bounds import (
    clopper_pearson,
    multi_run_epsilon_lower_bound,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)


def test_one_run_all_guesses_right_delta_zero():
    # Steinke et al. Thm 5.2 with δ = 0: p(ε) = P[Bin(r, q) >= v]. With v = r this is q^r, so the bound solves
    # q^r = β: q = β^(1/r), ε = log(q / (1 - q)).
    # r = 100, β = 0.05: q = exp(ln 0.05 / 100) = exp(-0.0299573) = 0.970487, ε = ln(0.970487 / 0.029513) = 3.49297.
    assert one_run_epsilon_lower_bound(m=1000, r=100, v=100, delta=0.0, beta=0.05) == pytest.approx(3.49297, abs=1e-4)
    # r = 10: q = 0.05^(1/10) = 0.741134, ε = ln(0.741134 / 0.258866) = 1.05185
    assert one_run_epsilon_lower_bound(m=10, r=10, v=10, delta=0.0, beta=0.05) == pytest.approx(1.05185, abs=1e-4)


def test_one_run_p_value_with_delta_by_hand():
    # App. D: p = f(v) + 2 m δ max_{i=1..v} (f(v-i) - f(v)) / i, f(u) = P[Bin(r, q) >= u], q = e^ε / (1 + e^ε).
    # m = r = v = 2, ε = ln 3 → q = 3/4. f(2) = 9/16 = 0.5625.
    # i = 1: P[Bin = 1] / 1 = 2·(3/4)·(1/4) = 0.375; i = 2: (P[Bin = 1] + P[Bin = 0]) / 2 = (0.375 + 0.0625) / 2
    # = 0.21875; max = 0.375. δ = 0.01: p = 0.5625 + 2·2·0.01·0.375 = 0.5775.
    assert one_run_p_value(2, 2, 2, math.log(3), 0.01) == pytest.approx(0.5775, abs=1e-12)
    assert one_run_p_value(2, 2, 2, math.log(3), 0.0) == pytest.approx(0.5625, abs=1e-12)
    # ε = 0: q = 1/2, f(2) = 1/4; i = 1: 2·(1/4) = 0.5; i = 2: (0.5 + 0.25)/2 = 0.375 → p = 0.25 + 4δ·0.5
    assert one_run_p_value(2, 2, 2, 0.0, 0.01) == pytest.approx(0.27, abs=1e-12)


def test_one_run_delta_lowers_the_bound_and_chance_gives_zero():
    no_delta = one_run_epsilon_lower_bound(1000, 100, 100, 0.0, 0.05)
    with_delta = one_run_epsilon_lower_bound(1000, 100, 100, 1e-5, 0.05)
    assert 0 < with_delta < no_delta  # δ > 0 can only make the guarantee weaker to refute
    assert one_run_epsilon_lower_bound(1000, 100, 50, 1e-5, 0.05) == 0.0  # half right = coin flips
    assert one_run_epsilon_lower_bound(1000, 0, 0, 1e-5, 0.05) == 0.0  # no guesses at all
    # the bound is the root of p(ε) = β
    eps = one_run_epsilon_lower_bound(200, 100, 90, 1e-5, 0.05)
    assert one_run_p_value(200, 100, 90, eps, 1e-5) == pytest.approx(0.05, abs=1e-6)


def test_clopper_pearson_by_hand():
    # k = n: lower = α^(1/n) (Beta(n, 1) has cdf x^n); k = 0: upper = 1 - α^(1/n).
    # n = 20, α = 0.025: 0.025^(1/20) = exp(-3.688879 / 20) = 0.831567
    lo, hi = clopper_pearson(20, 20, 0.025)
    assert (lo, hi) == (pytest.approx(0.831567, abs=1e-6), 1.0)
    lo, hi = clopper_pearson(0, 20, 0.025)
    assert (lo, hi) == (0.0, pytest.approx(1 - 0.831567, abs=1e-6))


def test_multi_run_bound_by_hand():
    # 20/20 runs with the canary flagged, 0/20 without, δ = 0, β = 0.05 (α = 0.025 per side):
    # TPR_lo = 0.831567, FPR_hi = 0.168433, ε ≥ ln(0.831567 / 0.168433) = ln(4.93708) = 1.59677.
    out = multi_run_epsilon_lower_bound(20, 20, 0, 20, delta=0.0, beta=0.05)
    assert out["epsilon_lower_bound"] == pytest.approx(1.59677, abs=1e-4)
    # δ = 0.1: ln((0.831567 - 0.1) / 0.168433) = ln(4.34338) = 1.46865 (the symmetric form gives the same here)
    out = multi_run_epsilon_lower_bound(20, 20, 0, 20, delta=0.1, beta=0.05)
    assert out["epsilon_lower_bound"] == pytest.approx(1.46865, abs=1e-4)
    # an attack no better than chance proves nothing
    assert multi_run_epsilon_lower_bound(10, 20, 10, 20, delta=0.0)["epsilon_lower_bound"] == 0.0


@pytest.mark.parametrize("args", [(10, 11, 5), (10, 5, 6), (-1, 0, 0)])
def test_bad_counts_are_refused(args):
    with pytest.raises(ValueError, match="need 0 <= v"):
        one_run_epsilon_lower_bound(*args, delta=0.0)
    with pytest.raises(ValueError, match="beta"):
        one_run_epsilon_lower_bound(10, 5, 5, delta=0.0, beta=1.5)
