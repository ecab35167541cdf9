"""`hf-dp-repr privacy` against Opacus' accountants, σ calibration, a full batch (q = 1), and the budgets it cannot
certify (infinite, NaN, below the accountant's floor) refused with what to do."""

import json
import subprocess
import sys
import warnings

import pytest
from opacus.accountants import create_accountant

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.cli import main
from utils import gaussian_epsilon


def run_cli(capsys, *argv):
    assert main(["privacy", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_epsilon_agrees_with_opacus(accountant, capsys):
    out = run_cli(capsys, "--sample-rate", "0.004", "--noise-multiplier", "1.1", "--steps", "2500",
                  "--delta", "1e-5", "--accountant", accountant)
    reference = create_accountant(mechanism=accountant)
    reference.history = [(1.1, 0.004, 2500)]
    assert out["epsilon"] == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
@pytest.mark.parametrize("target", [0.5, 1.0, 8.0])
def test_calibrated_sigma_reaches_target_within_one_percent(target, accountant, capsys):
    out = run_cli(capsys, "--sample-rate", "0.01", "--target-epsilon", str(target), "--steps", "1000",
                  "--delta", "1e-5", "--accountant", accountant)
    reference = create_accountant(mechanism=accountant)
    reference.history = [(out["noise_multiplier"], 0.01, 1000)]
    reached = reference.get_epsilon(delta=1e-5)
    assert 0.99 * target <= reached <= target  # never above the budget
    assert out["epsilon"] == pytest.approx(reached, rel=1e-9)


def test_console_script_and_bad_input():
    ok = subprocess.run([sys.executable, "-m", "hf_dp_repr.cli", "privacy", "--sample-rate", "0.01",
                         "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["epsilon"] > 0
    bad = subprocess.run([sys.executable, "-m", "hf_dp_repr.cli", "privacy", "--sample-rate", "1.5",
                          "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--sample-rate" in bad.stderr


def test_gdp_is_refused_and_replace_one_needs_pld(capsys):
    with pytest.raises(SystemExit, match="'gdp' accountant is refused"):
        main(["privacy", "--sample-rate", "0.05", "--noise-multiplier", "0.9", "--steps", "3", "--delta", "1e-5",
              "--accountant", "gdp"])
    with pytest.raises(SystemExit, match="needs --accountant pld"):
        main(["privacy", "--sample-rate", "0.05", "--noise-multiplier", "0.9", "--steps", "3", "--delta", "1e-5",
              "--accountant", "prv", "--neighboring", "replace_one"])
    out = run_cli(capsys, "--sample-rate", "1.0", "--noise-multiplier", "4.0", "--steps", "10", "--delta", "1e-5",
                  "--accountant", "pld", "--neighboring", "replace_one")
    assert out["neighboring"] == "replace_one"
    assert out["epsilon"] == pytest.approx(run_cli(capsys, "--sample-rate", "1.0", "--noise-multiplier", "2.0",
                                                   "--steps", "10", "--delta", "1e-5", "--accountant", "pld",
                                                   "--neighboring", "add_remove")["epsilon"],
                                           rel=1e-6)


def test_defaults_are_the_trainers(capsys):
    """Planned from the shell as DPTrainer plans it: the same accountant and neighbouring relation by default."""

    args = DPTrainingArguments(output_dir="unused", noise_multiplier=1.0, target_delta=1e-5, report_to="none")
    out = run_cli(capsys, "--sample-rate", "0.01", "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5")
    assert (out["accountant"], out["neighboring"]) == (args.accountant, args.neighboring) == ("pld", "replace_one")
    rdp = run_cli(capsys, "--sample-rate", "0.01", "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5",
                  "--accountant", "rdp")
    assert rdp["neighboring"] == "add_remove"


@pytest.mark.parametrize("value, message", [("inf", "--noise-multiplier 0"), ("nan", "NaN")])
def test_privacy_cli_refuses_an_infinite_target(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["privacy", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--target-epsilon", value])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_privacy_cli_says_what_a_too_low_budget_would_need():
    with pytest.raises(SystemExit, match=r"hf-dp-repr privacy: target_epsilon=0.001 .*Reachable: target_epsilon="):
        main(["privacy", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--target-epsilon", "0.001",
              "--accountant", "prv"])  # pld certifies it (σ = 5120): prv has a floor


def test_privacy_cli_accounts_for_a_full_batch(capsys):
    from hf_dp_repr.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert main(["privacy", "--sample-rate", "1", "--noise-multiplier", "2", "--steps", "10", "--delta",
                     "1e-5"]) == 0
    out = json.loads(capsys.readouterr().out)
    eps = out["epsilon"]
    assert out["neighboring"] == "replace_one"  # the default: sensitivity 2C, the add/remove ε at σ/2
    exact = gaussian_epsilon(1.0, 10, 1e-5)
    assert exact <= eps <= 1.01 * exact


# ---- info: a saved run's guarantee from its ledger ------------------------------------------------------------------
GOLDEN = __import__("pathlib").Path(__file__).resolve().parent / "golden"


@pytest.mark.parametrize("golden", ["lp_ft_two_phases", "privacy_unit"])
def test_info_prints_a_saved_runs_guarantee_from_its_ledger(golden, tmp_path, capsys):
    """The golden ledgers were written by real runs: ε is the one the run saved (recomputed from the ledger's
    history by the run's accountant), with δ, the unit, the steps and the ledger's own attack bounds."""
    import shutil

    from hf_dp_repr.privacy.ledger import PrivacyLedger

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(GOLDEN / f"{golden}.privacy_ledger.json", run / "privacy_ledger.json")
    saved = json.loads((run / "privacy_ledger.json").read_text())
    assert main(["info", str(run)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["epsilon"] == pytest.approx(saved["epsilon"], rel=1e-9)
    assert (info["delta"], info["privacy_unit"], info["units"]) == (saved["target_delta"], saved["privacy_unit"],
                                                                   saved["dataset_size"])
    assert info["steps"] == saved["steps_done"] == sum(t for _, _, t in saved["history"])
    rates = PrivacyLedger.load(str(run)).attack_rates()
    assert info["attack_bounds"]["tpr_at_fpr"] == {f"{f:g}": t for f, t in rates.tpr_at_fpr.items()}
    assert "membership test can reach at most" in info["attack_bounds"]["in_words"]


def test_info_on_a_folder_without_a_ledger_is_one_line_naming_the_checkpoint(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not the output_dir of a finished DP run" in err
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "privacy_ledger.json").write_text("{}")
    assert main(["info", str(tmp_path)]) == 2
    assert f"hf-dp-repr info {tmp_path / 'checkpoint-4'}" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "checkpoint-4")]) == 1  # a corrupted ledger: the ledger's own error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupted" in err
