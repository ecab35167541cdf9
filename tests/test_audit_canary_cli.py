"""`hf-dp-repr audit canaries`: the one-run canary audit from the command line (Dirac canaries by default); every
bad input refused before anything is written."""

import json

import pytest

from hf_dp_repr.cli import main
from hf_dp_repr.tiny import tiny_vit

QUICK = ["--max_steps", "40", "--per_device_train_batch_size", "32", "--logging_strategy", "no", "--disable_tqdm",
         "true", "--target_delta", "1e-5"]


@pytest.fixture(scope="module")
def folders(digits, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("canary-cli")
    tiny_vit(hidden_size=16, num_hidden_layers=1, intermediate_size=32).save_pretrained(str(tmp / "model"))
    digits["train"].select(range(64)).save_to_disk(str(tmp / "train"))
    return tmp


def _argv(folders, *extra, training=("--noise_multiplier", "0")):
    return ["audit", "canaries", "--model", str(folders / "model"), "--train", str(folders / "train"), *extra,
            "--", *QUICK, *training]


def test_dirac_canary_audit_of_a_run_without_noise(folders, tmp_path, capsys):
    out = tmp_path / "audit"
    # the draw is secret (no seed here): 64 canaries leave fewer than k = 8 in or out with probability 8e-11, and
    # σ = 0 at sample rate ~1/3 over 40 steps leaves one of ~32 included canaries unsampled with probability 4e-6
    assert main(_argv(folders, "--canaries", "64", "--k", "8", "--out", str(out))) == 0
    report = json.loads((out / "privacy_audit_canaries.json").read_text())
    assert report["kind"] == "dirac" and report["canaries"] == 64 and report["claimed_epsilon"] is None
    assert report["correct"] == report["guesses"] == 16 and report["epsilon_lower_bound"] > 1.5
    assert not any(isinstance(v, list) for v in report.values())  # counts only: the secret draw is not written
    assert sorted(p.name for p in out.iterdir()) == ["privacy_audit_canaries.json"]  # the audit's run is not saved
    printed = capsys.readouterr()
    assert "16 of 16 guesses right" in printed.out
    # sampled ~13 times each: the ceiling is the bound of 16 right guesses, and ε = ∞ (σ = 0) gets no warning
    assert report["epsilon_ceiling"] == pytest.approx(report["epsilon_lower_bound"]) and "WARNING" not in printed.err


def test_an_audit_too_weak_for_the_claimed_epsilon_says_so_before_training(folders, tmp_path, capsys):
    """The review's run (20 steps, each canary sampled 0.43 times) missed noise switched off without a word."""
    from hf_dp_repr.audit.bounds import one_run_ceiling

    out = tmp_path / "weak"
    weak = ("--target_epsilon", "8", "--max_steps", "2", "--per_device_train_batch_size", "8")
    assert main(_argv(folders, "--canaries", "64", "--k", "8", "--out", str(out), training=weak)) == 0
    printed = capsys.readouterr()
    report = json.loads((out / "privacy_audit_canaries.json").read_text())
    # q = 8 / (64 rows + 32 canaries expected), 2 steps: an included canary is sampled with probability 1 - (1 - q)²
    q = 8 / 96
    assert report["epsilon_ceiling"] == pytest.approx(one_run_ceiling(64, 8, 1 - (1 - q) ** 2, 1e-5), abs=1e-9)
    assert report["epsilon_ceiling"] < 1 < report["claimed_epsilon"] <= 8
    assert f"each canary is sampled {2 * q:.3g} times on average" in printed.out
    assert printed.out.index("can certify at most ε") < printed.out.index("guesses right")  # before training's end
    assert "WARNING: the audit cannot certify the claimed ε = 8" in printed.err


def _refused(argv, out, match):
    with pytest.raises(SystemExit, match=match):
        main(argv + ["--out", str(out)] if "--" not in argv else
             argv[:argv.index("--")] + ["--out", str(out)] + argv[argv.index("--"):])
    assert not out.exists()  # nothing written


def test_bad_canary_audits_are_refused(folders, digits, tmp_path):
    out = tmp_path / "r"
    _refused(_argv(folders, "--canaries", "10", "--k", "6"), out, "need 0 < 2k <= m")
    _refused(_argv(folders, "--kind", "ood"), out, "--kind ood makes its canaries from --canary-source")
    _refused(_argv(folders, "--canary-source", "digits:test"), out, "Dirac canaries are gradients")
    digits["train"].select(range(60, 200)).save_to_disk(str(tmp_path / "overlap"))
    _refused(_argv(folders, "--kind", "ood", "--canary-source", str(tmp_path / "overlap")), out,
             r"4 row\(s\) of --canary-source are also in --train")
    _refused(_argv(folders, "--kind", "mislabelled", "--canary-source", "digits:test", "--canaries", "1000",
                   "--k", "10"), out, "--canary-source has 360 rows")
    _refused(_argv(folders, training=("--noise_multiplier", "0", "--save_strategy", "steps")), out,
             "not a model to keep")
    _refused(_argv(folders, training=("--noise_multiplier", "0", "--output_dir", str(tmp_path / "run"))), out,
             "the audit's run is not kept")
    _refused(_argv(folders, training=("--noise_multiplier", "0", f"--output_dir={tmp_path / 'run'}")), out,
             "^hf-dp-repr audit canaries: --output_dir: the audit's run is not kept")
    _refused(_argv(folders, training=("--target_epsilon", "1", "--accountant", "pld", "--neighboring",
                                      "replace_one")), out, "tests add/remove")
    _refused(_argv(folders, training=("--noise_multiplier", "0", "--privacy_unit", "user_id")), out,
             "--privacy_unit user_id")
    _refused(_argv(folders, training=("--target_epsilon", "1", "--noise_multiplier", "1")), out, "training arguments")
    _refused(_argv(folders, training=("--noise_multiplier", "0", "--no_such_flag", "1")), out, "no_such_flag")
    _refused(["audit", "canaries", "--model", str(tmp_path), "--train", "digits:train", "--", "--noise_multiplier",
              "0"], out, "not a model folder")
