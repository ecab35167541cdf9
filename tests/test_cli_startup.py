"""The first seconds of the command and of `import hf_dp_repr`: `--help`, a typo and `privacy` import neither torch
nor transformers; argument errors are one line naming the closest valid argument, exit code 2; the OpenMP wait
policy is passive without a call, and a process that loaded torch first with spinning threads is warned once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dp_repr.cli import main

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "opacus", "datasets")
# Runs the command in a fresh interpreter and prints its exit code and which heavy modules it imported.
PROBE = """
import json, sys
from hf_dp_repr.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
print("PROBE" + json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _probe(*argv):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300)
    return json.loads(out.stdout.rsplit("PROBE", 1)[1]), out.stderr


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["traine"],  # a mistyped command
    ["privacy", "--sample-rate", "0.01", "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5"],
    ["privacy", "--sample-rate", "0.01", "--target-epsilon", "3", "--steps", "100", "--delta", "1e-5"],
    ["privacy", "--sample-rate", "2", "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5"],
    ["push", "--help"],
    ["train", "--help"],
    ["train", "image", "--help"],  # the recipe's saved usage: it answers at once
    ["train", "sft", "--help"],
    ["synth", "--help"],
], ids=["help", "typo", "privacy-epsilon", "privacy-calibrate", "privacy-bad-value", "push-help", "train-help",
        "train-image-help", "train-sft-help", "synth-help"])
def test_help_typos_and_privacy_import_neither_torch_nor_transformers(argv):
    seen, stderr = _probe(*argv)
    assert seen["heavy"] == [], (argv, seen, stderr[-2000:])


def test_info_reads_the_ledger_without_torch(tmp_path):
    import shutil

    shutil.copy(ROOT / "tests" / "golden" / "privacy_unit.privacy_ledger.json", tmp_path / "privacy_ledger.json")
    seen, stderr = _probe("info", str(tmp_path))
    assert seen == {"code": 0, "heavy": []}, stderr[-2000:]


def test_a_mistyped_command_is_one_line_naming_the_closest(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["traine"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "did you mean 'train'?" in err and err.startswith("hf-dp-repr: error:")


def test_a_mistyped_option_of_a_command_names_the_closest(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["privacy", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "1",
              "--acountant", "rdp"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "unrecognized argument --acountant; did you mean --accountant?" in err


@pytest.mark.parametrize("argv, expected", [
    (["--traget_epsilon", "3"], "unrecognized argument --traget_epsilon; did you mean --target_epsilon?"),
    (["--target_epsilon", "-1"], "target_epsilon must be > 0, got -1.0"),
])
def test_a_recipe_argument_error_is_one_line_and_exit_code_2(argv, expected, capsys, tmp_path):
    code = main(["train", "image", "--output_dir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("hf-dp-repr train image: error: ") and expected in err
    assert not any(tmp_path.iterdir())  # refused before any work


def _python(code: str, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**base, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_import_sets_a_passive_wait_policy_before_torch_loads_and_respects_the_users():
    code = "import os, hf_dp_repr; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert _python(code) == "PASSIVE"
    assert _python(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    # torch loaded first: its OpenMP runtime has read the policy already, so nothing is set (it would not apply)
    assert _python("import os, torch, hf_dp_repr; print(os.environ.get('OMP_WAIT_POLICY'))") == "None"


WARN_ONCE = """
import os, warnings, torch
import hf_dp_repr
from hf_dp_repr.entry_point import warn_if_openmp_spins
torch.set_num_threads(2)
warned = []
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for load in (0.0, os.cpu_count(), os.cpu_count()):  # idle, then loaded twice
        os.getloadavg = lambda: (load,) * 3
        warned.append(warn_if_openmp_spins())
print(warned, [str(w.message) for w in seen])
"""


def test_spinning_threads_on_a_loaded_machine_are_warned_once_naming_the_fix():
    spinning = _python(WARN_ONCE)
    assert spinning.startswith("[False, True, False]") and spinning.count("spin at barriers") == 1
    assert "import hf_dp_repr` before `import torch`" in spinning and "OMP_WAIT_POLICY=PASSIVE" in spinning
    # passive threads (set before torch loaded): nothing to warn about, loaded or not
    assert _python(WARN_ONCE, OMP_WAIT_POLICY="PASSIVE").startswith("[False, False, False]")


def test_training_start_checks_for_spinning_threads():
    """announce_plan (run as the DP optimizer is made, when training starts) calls the check."""
    import inspect

    from hf_dp_repr.training import privacy_report

    assert "warn_if_openmp_spins()" in inspect.getsource(privacy_report.announce_plan)
