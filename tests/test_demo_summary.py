"""The demo's report: summary.json is valid JSON (ε = ∞ of the non-private reference is null, said in words)."""

import json
import math

import pytest

from hf_dp_repr.scripts import demo


def _refuse(constant):
    raise ValueError(f"not valid JSON: {constant}")


def test_summary_json_has_no_infinity_and_says_which_run_is_not_private():
    rows = {name: dict(epsilon=eps, delta=1e-4, noise_multiplier=[sigma], accuracy=acc, rho_fuzziness=0.5,
                       rho_residual=0.9, seconds=1.0, law_entry={}, first_law_entry={})
            for name, eps, sigma, acc in [("public_only", 0.0, None, 0.6), ("dp_eps1", 0.99, 4.0, 0.8),
                                          ("dp_eps8", 7.9, 1.0, 0.85), ("non_private", math.inf, 0.0, 0.9)]}
    text = json.dumps(demo._summary(rows, gap=10.0, seconds=3.0), indent=2, default=str, allow_nan=False)
    summary = json.loads(text, parse_constant=_refuse)
    runs = summary["runs"]
    assert runs["non_private"]["epsilon"] is None and runs["non_private"]["differentially_private"] is False
    assert runs["dp_eps1"]["epsilon"] == 0.99 and runs["dp_eps1"]["differentially_private"] is True
    assert "law_entry" not in runs["dp_eps8"] and summary["within_acceptance"] is False
    assert "| non_private | ∞ |" in demo._table(rows)  # the printed table still says ∞
    with pytest.raises(ValueError, match="Infinity"):
        json.loads(json.dumps({"epsilon": math.inf}), parse_constant=_refuse)  # what main wrote
