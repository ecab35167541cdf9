"""What a guarantee means for a membership attacker (privacy/attack_rates.py): checked against the closed forms of
the Gaussian mechanism, alone and composed, and shown wherever ε is (ledger summary, CLI, card, end-of-training log)."""

import ast
import json
import math
import pathlib

import pytest
from scipy.stats import norm

from hf_dp_repr.hub.card_values import format_epsilon
from hf_dp_repr.privacy.accounting import compute_epsilon
from hf_dp_repr.privacy.attack_rates import ATTACK_FPRS, attack_rates, attack_rates_from_epsilon, tpr_at_fpr

TOL = 2e-3  # the pessimistic PLD grid (1e-3 in the privacy loss) raises the bounds by at most this much here


def gaussian_tpr(fpr: float, mu: float) -> float:
    """μ-GDP's trade-off curve: the exact largest TPR at `fpr` for N(0, 1) against N(μ, 1)."""
    return float(norm.cdf(norm.ppf(fpr) + mu))


def assert_gaussian(rates, mu):
    for fpr in ATTACK_FPRS:
        exact = gaussian_tpr(fpr, mu)
        assert exact - 1e-6 <= rates.tpr_at_fpr[fpr] <= exact + TOL, (fpr, rates.tpr_at_fpr[fpr], exact)
    exact_advantage = 2 * norm.cdf(mu / 2) - 1
    assert exact_advantage - 1e-6 <= rates.advantage <= exact_advantage + TOL


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_one_gaussian_mechanism_is_the_closed_form(sigma):
    """Sensitivity 1 (add/remove, q = 1, one step): TPR = Φ(Φ⁻¹(FPR) + 1/σ); replace-one moves the sum by 2C."""
    assert_gaussian(attack_rates([(sigma, 1.0, 1)], "add_remove"), 1 / sigma)
    assert_gaussian(attack_rates([(sigma, 1.0, 1)], "replace_one"), 2 / sigma)


def test_composition_of_several_gaussian_mechanisms():
    """k steps of σ, then m of σ': μ = √(k/σ² + m/σ'²), the exact composition of Gaussian mechanisms."""
    assert_gaussian(attack_rates([(2.0, 1.0, 9)], "add_remove"), 3 / 2.0)
    assert_gaussian(attack_rates([(2.0, 1.0, 4), (4.0, 1.0, 12)], "add_remove"), math.sqrt(4 / 4 + 12 / 16))
    # more steps never help the defender
    a, b = attack_rates([(1.0, 0.01, 100)], "replace_one"), attack_rates([(1.0, 0.01, 1000)], "replace_one")
    assert all(a.tpr_at_fpr[f] < b.tpr_at_fpr[f] for f in ATTACK_FPRS) and a.advantage < b.advantage


def test_subsampled_bounds_are_within_what_epsilon_delta_allows_and_tighter():
    """A profile's bound is never looser than its own (ε, δ) pair's, and at ε ≈ 2.5 much tighter at low FPR."""
    history, delta = [(1.1, 0.01, 1000)], 1e-5
    eps = compute_epsilon(history, delta, "pld", "replace_one")
    profile = attack_rates(history, "replace_one")
    pair = attack_rates_from_epsilon(eps, delta, "replace_one")
    for fpr in ATTACK_FPRS:
        assert fpr <= profile.tpr_at_fpr[fpr] <= min(1.0, math.exp(eps) * fpr + delta) + 1e-9
        assert profile.tpr_at_fpr[fpr] <= pair.tpr_at_fpr[fpr]
    assert profile.tpr_at_fpr[0.01] < 0.5 * pair.tpr_at_fpr[0.01]
    assert profile.advantage <= pair.advantage


def test_no_noise_and_no_step():
    none = attack_rates([(0.0, 0.1, 5)], "replace_one")
    assert set(none.tpr_at_fpr.values()) == {1.0} and none.advantage == 1.0
    untouched = attack_rates([], "replace_one")
    assert untouched.tpr_at_fpr == {f: f for f in ATTACK_FPRS} and untouched.advantage == 0.0
    assert attack_rates_from_epsilon(math.inf, 1e-5, "replace_one").advantage == 1.0


def test_the_module_imports_neither_torch_nor_transformers():
    """`hf-dp-repr privacy` computes it: only numpy, dp_accounting and riskcal (and the standard library)."""
    tree = ast.parse((pathlib.Path(__file__).parents[1] / "hf_dp_repr/privacy/attack_rates.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert names <= {"__future__", "functools", "math", "dataclasses", "numpy", "dp_accounting", "riskcal"}, names


def test_the_cli_ledger_summary_and_card_state_them(capsys):
    from hf_dp_repr.cli import main
    from hf_dp_repr.hub.card_values import template_values
    from hf_dp_repr.privacy.ledger import Phase, PrivacyLedger, PrivacyPlan

    assert main(["privacy", "--sample-rate", "1", "--noise-multiplier", "2", "--steps", "4", "--delta", "1e-5",
                 "--neighboring", "add_remove"]) == 0
    bounds = json.loads(capsys.readouterr().out)["attack_bounds"]
    assert bounds["neighboring"] == "add_remove"
    assert bounds["tpr_at_fpr"]["0.01"] == pytest.approx(gaussian_tpr(0.01, 1.0), abs=TOL)
    assert "TPR 1.83 % at FPR 0.1 %" in bounds["in_words"]

    plan = PrivacyPlan(accountant="pld", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat",
                       dataset_size=100, poisson_sampling=True, phases=[Phase("train", 2.0, 1.0, 8, 100)],
                       neighboring="add_remove")
    ledger = PrivacyLedger(plan, steps_done=4)
    assert "for add/remove neighbours (pld); a membership test can reach at most TPR 1.83 % at FPR 0.1 %" \
        in ledger.summary()
    # the card states the replace-one guarantee, whatever the plan's relation: 2/σ per step, μ = 2
    values = template_values(ledger.to_dict(), {}, "all", None, None)
    rows = dict(values["epsilon_rows"])
    tpr = rows["largest TPR of any membership test at FPR 0.1 % / 1 % / 10 % (from the run's privacy loss "
               "distribution)"]
    assert tpr.split(" / ")[1] == f"{100 * gaussian_tpr(0.01, 2.0):.3g} %"
    assert "For an attacker, a membership test can reach at most" in values["summary"]


# ---- a target given as an attack rate (target_attack_tpr_at_fpr) calibrates σ as target_epsilon does -----------------
@pytest.mark.parametrize("neighboring, sensitivity", [("add_remove", 1.0), ("replace_one", 2.0)])
def test_attack_target_calibrates_sigma_to_the_closed_form(neighboring, sensitivity):
    """One full-batch step (q = 1) is one Gaussian mechanism: its largest TPR at FPR f is Φ(Φ⁻¹(f) + Δ/σ). The σ the
    plan calibrates for "0.05@0.01" gives TPR ≤ 5 % at FPR 1 %, and 0.1 % less noise gives more."""
    from hf_dp_repr.training.plan import plan_run
    from utils import dp_args

    args = dp_args(pathlib.Path("/tmp/attack-target"), target_epsilon=None, target_attack_tpr_at_fpr="0.05@0.01",
                   neighboring=neighboring, per_device_train_batch_size=64, max_steps=1)
    plan = plan_run(args, dataset_size=64)
    (phase,) = plan.phases
    assert (phase.sample_rate, phase.steps) == (1.0, 1)
    sigma = phase.noise_multiplier
    assert gaussian_tpr(0.01, sensitivity / sigma) <= 0.05 < gaussian_tpr(0.01, sensitivity / (0.999 * sigma))
    # the same from the PLD the card states it from (an upper bound): met, and tight
    assert tpr_at_fpr([(sigma, 1.0, 1)], 0.01, neighboring) <= 0.05 < tpr_at_fpr([(0.999 * sigma, 1.0, 1)], 0.01,
                                                                                   neighboring)
    assert plan.target_attack_tpr_at_fpr == "0.05@0.01" and plan.target_epsilon is None
    assert plan.planned_epsilon() == compute_epsilon([(sigma, 1.0, 1)], 1e-4, "pld", neighboring)


@pytest.mark.parametrize("target", ["0.05@0.01", "0.2@0.1"])
def test_attack_target_over_many_full_batch_steps_calibrates(target):
    """50 full-batch steps compose to Φ(Φ⁻¹(f) + 2√50/σ) (replace-one): the plan calibrates σ to that closed form
    (20.75 for 0.05@0.01), where the σ search died with OverflowError (seen failing so)."""
    from hf_dp_repr.training.plan import plan_run
    from utils import dp_args

    tpr, fpr = (float(x) for x in target.split("@"))
    args = dp_args(pathlib.Path("/tmp/attack-target"), target_epsilon=None, target_attack_tpr_at_fpr=target,
                   neighboring="replace_one", per_device_train_batch_size=64, max_steps=50)
    (phase,) = plan_run(args, dataset_size=64).phases
    closed_form = 2 * math.sqrt(50) / (norm.ppf(tpr) - norm.ppf(fpr))
    assert phase.noise_multiplier == pytest.approx(closed_form, rel=2e-3)
    assert tpr_at_fpr([(phase.noise_multiplier, 1.0, 50)], fpr, "replace_one") <= tpr


def test_an_epsilon_split_set_after_the_checks_is_refused_with_an_attack_target():
    """sweep_budget_split sets lp_epsilon_fraction on checked arguments: the plan refuses it (there is no ε to split)
    instead of ignoring it."""
    from hf_dp_repr.errors import DPConfigError
    from hf_dp_repr.training.plan import plan_run
    from utils import dp_args

    args = dp_args(pathlib.Path("/tmp/attack-target"), target_epsilon=None, target_attack_tpr_at_fpr="0.1@0.01",
                   per_device_train_batch_size=50, max_steps=4, lp_steps=0.5)
    args.lp_epsilon_fraction = 0.3
    with pytest.raises(DPConfigError, match="lp_epsilon_fraction=0.3 splits target_epsilon"):
        plan_run(args, dataset_size=100)


def test_attack_target_composes_over_the_plan():
    """Several subsampled steps: the whole planned history meets the target (within 0.1 % of TPR − FPR below it)."""
    from hf_dp_repr.training.plan import plan_run
    from utils import dp_args

    args = dp_args(pathlib.Path("/tmp/attack-target"), target_epsilon=None, target_attack_tpr_at_fpr="0.1@0.01",
                   per_device_train_batch_size=50, max_steps=4)
    plan = plan_run(args, dataset_size=100)
    assert plan.history() == [(plan.phases[0].noise_multiplier, 0.5, 4)]
    tpr = tpr_at_fpr(plan.history(), 0.01, "replace_one")
    assert 0.1 - 1e-3 * (0.1 - 0.01) <= tpr <= 0.1


def test_privacy_command_calibrates_for_an_attack_target(capsys):
    from hf_dp_repr.cli import main

    assert main(["privacy", "--sample-rate", "1", "--target-attack-tpr-at-fpr", "0.05@0.01", "--steps", "1",
                 "--delta", "1e-5", "--neighboring", "add_remove"]) == 0
    out = json.loads(capsys.readouterr().out)
    sigma = out["noise_multiplier"]
    assert out["target_attack_tpr_at_fpr"] == "0.05@0.01" and out["epsilon"] > 0
    assert gaussian_tpr(0.01, 1 / sigma) <= 0.05 < gaussian_tpr(0.01, 1 / (0.999 * sigma))
    with pytest.raises(SystemExit):  # refused by argparse, before any calibration
        main(["privacy", "--sample-rate", "1", "--target-attack-tpr-at-fpr", "0.01@0.05", "--steps", "1",
              "--delta", "1e-5"])
    assert "--target-attack-tpr-at-fpr='0.01@0.05': the true-positive rate 0.01 must be in (FPR, 1)" \
        in capsys.readouterr().err


def test_ledger_card_and_log_state_the_attack_target_and_its_epsilon(digits, tmp_path):
    """A run with target_attack_tpr_at_fpr: its ledger file, end-of-training log, plan log line and model card
    state the target and the ε it gave."""
    from transformers import logging as hf_logging
    from transformers.testing_utils import CaptureLogger

    from hf_dp_repr import DPTrainer
    from hf_dp_repr.privacy.ledger import PrivacyLedger
    from hf_dp_repr.tiny import tiny_vit
    from utils import dp_args

    args = dp_args(tmp_path, target_epsilon=None, target_attack_tpr_at_fpr="0.2@0.01", per_device_train_batch_size=64,
                   max_steps=1, log_level="info")
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(64)))
    with CaptureLogger(hf_logging.get_logger("hf_dp_repr.trainer")) as cl:
        trainer.train()
    trainer.save_model()
    ledger = PrivacyLedger.load(args.output_dir)
    saved = json.loads((tmp_path / "run" / "privacy_ledger.json").read_text())
    assert saved["target_attack_tpr_at_fpr"] == "0.2@0.01" and saved["target_epsilon"] is None
    eps = ledger.epsilon()
    assert saved["epsilon"] == pytest.approx(eps) and 0 < eps < math.inf
    assert ledger.attack_rates().tpr_at_fpr[0.01] <= 0.2
    assert "DP-SGD plan (target_attack_tpr_at_fpr=0.2@0.01" in cl.out
    assert f"(ε = {eps:.4g}, δ = 0.0001)" in cl.out and "(σ calibrated for target_attack_tpr_at_fpr=0.2@0.01)" in cl.out
    card = (tmp_path / "run" / "README.md").read_text()
    assert ("| target attack rate | a membership test can reach at most TPR 20 % at FPR 1 %, for replace-one "
            "neighbours (`target_attack_tpr_at_fpr=0.2@0.01`) |") in card
    assert "| target ε | none (σ calibrated for the target attack rate below) |" in card
    assert f"(ε = {format_epsilon(eps)}, δ = 0.0001)" in card


def test_the_grid_is_coarser_only_for_tiny_sigma_and_then_only_raises_the_bounds():
    """At σ = 0.01 the 1e-3 privacy-loss grid had millions of points (minutes at the end of a run); the coarser grid
    `pld_discretization` picks below σ ≈ 0.17 must keep every bound an upper bound: ε and the TPR bounds from it are
    never below those of the 1e-3 grid."""
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    from hf_dp_repr.privacy.accounting import compute_epsilon
    from hf_dp_repr.privacy.attack_rates import PLD_DISCRETIZATION, pld_discretization, tpr_at_fpr

    assert pld_discretization([(0.17, 0.01, 1000), (1.0, 0.1, 5)]) == PLD_DISCRETIZATION  # usual runs: unchanged
    history = [(0.08, 0.5, 2)]
    assert pld_discretization(history) > 2 * PLD_DISCRETIZATION
    fine = PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-3)
    fine.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(0.08)), 2)
    assert compute_epsilon(history, 1e-5, "pld", "replace_one") >= fine.get_epsilon(1e-5)
    closed_form_one_step = norm.cdf(norm.ppf(0.01) + 2 / 0.08)  # q = 1, one step: the bound is exact
    assert tpr_at_fpr([(0.08, 1.0, 1)], 0.01, "replace_one") >= closed_form_one_step - 1e-9
