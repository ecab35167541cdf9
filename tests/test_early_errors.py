"""Settings that used to be silently wrong or fail late with a raw error are refused at once, naming the
argument and the fix, before anything is written."""

import math

import pytest

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.cli import main


@pytest.mark.parametrize("kwargs, message", [
    ({"target_epsilon": math.inf}, r"target_epsilon=inf is no privacy budget.*noise_multiplier=0"),
    ({"target_epsilon": math.nan}, r"target_epsilon is NaN"),
    ({"noise_multiplier": math.nan}, r"noise_multiplier must be >= 0 and finite"),
    ({"noise_multiplier": math.inf}, r"noise_multiplier must be >= 0 and finite"),
])
def test_non_finite_budgets_are_refused(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        DPTrainingArguments(output_dir=str(tmp_path / "never"), report_to="none", **kwargs)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("value, message", [("inf", "--noise-multiplier 0"), ("nan", "NaN")])
def test_privacy_cli_refuses_an_infinite_target(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["privacy", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--target-epsilon", value])
    assert e.value.code == 2 and message in capsys.readouterr().err
