"""Several processes under `accelerate launch` (gloo on CPU), against the same run in 1 process.

A real 2-process run of the image recipe: with σ = 1000 the noise dominates the clipped gradient sum (at most
B·C = 32 against a noise norm of σ·C·√P ≈ 3.7e5), so one SGD step's update Δ = −lr·(Σ clip(g_i) + N(0, σ²C²)) / B
has a per-coordinate std of lr·σ·C/B. Noise added once per logical batch gives the same std with 1 or 2 processes;
noise added on every process would give √2 times more with 2 (2 times if the ranks drew the same noise), and dividing
by the per-process batch would give 2 times more. (Both runs pass the same `noise_seed`, so rank 0 draws the noise
the single process draws, and the two updates are in fact nearly identical.) Also: a privacy unit is clipped once
across ranks, and the recipes log the plan and the results once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import ViTForImageClassification

from hf_dp_repr.tiny import tiny_vit
from utils import ACCEL_CONFIG, brute_force_unit_sum, free_port, norm_of_difference, user_dataset

pytestmark = pytest.mark.slow  # several processes under accelerate launch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "dp_image_classification.py"
SIGMA, LR, GLOBAL_BATCH = 1000.0, 1e-3, 32


def _args(out: Path, per_device: int, sigma: float = SIGMA, steps: int = 1) -> list[str]:
    return [str(RECIPE), "--output_dir", str(out), "--public_fraction", "0", "--noise_multiplier", str(sigma),
            "--per_device_train_batch_size", str(per_device), "--max_steps", str(steps), "--optim", "sgd",
            "--learning_rate", str(LR), "--lr_scheduler_type", "constant", "--weight_decay", "0",
            "--target_delta", "1e-4", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
            "--max_eval_samples", "64", "--seed", "0", "--noise_seed", "0"]


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _update_std(out: Path) -> float:
    """Std over all coordinates of (weights after one step − initial weights) / lr."""
    before = tiny_vit(num_labels=10, seed=0, num_channels=1, image_size=8).state_dict()
    after = ViTForImageClassification.from_pretrained(out).state_dict()
    assert set(after) == set(before)
    deltas = [(after[k] - before[k]).flatten() for k in after]
    return float(torch.cat(deltas).std() / LR)


def _one_and_two_processes(base: Path, sigma: float, steps: int = 1, extra: tuple[str, ...] = ()) -> tuple[Path, Path]:
    _run([sys.executable, *_args(base / "one", GLOBAL_BATCH, sigma, steps), *extra])
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCEL_CONFIG),
          "--main_process_port", str(free_port()), *_args(base / "two", GLOBAL_BATCH // 2, sigma, steps), *extra])
    return base / "one", base / "two"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _one_and_two_processes(tmp_path_factory.mktemp("ddp"), SIGMA)


def test_two_processes_account_the_global_logical_batch(runs):
    one, two = (json.loads((d / "privacy_ledger.json").read_text()) for d in runs)
    assert two["world_size"] == 2 and one["world_size"] == 1
    for led in (one, two):
        (phase,) = led["phases"]
        assert phase["expected_batch_size"] == GLOBAL_BATCH  # per device 16 × accumulation 1 × 2 processes
        assert phase["sample_rate"] == pytest.approx(GLOBAL_BATCH / led["dataset_size"])
        assert led["steps_done"] == 1
    assert two["epsilon"] == pytest.approx(one["epsilon"])  # same history → same accountant ε


def test_noise_is_added_once_per_update_not_once_per_process(runs):
    std_one, std_two = (_update_std(d) for d in runs)
    expected = SIGMA * 1.0 / GLOBAL_BATCH  # σ·C/B with C = 1
    assert std_one == pytest.approx(expected, rel=0.02)
    ratio = std_two / std_one
    print(f"update std: 1 process {std_one:.3f}, 2 processes {std_two:.3f}, ratio {ratio:.4f} (√2 = 1.414)")
    assert ratio == pytest.approx(1.0, abs=0.03), f"ratio {ratio:.3f}: noise is not added once per logical batch"


def test_without_noise_two_processes_make_the_single_process_update(tmp_path):
    """σ = 0: the clipped per-example gradients of both ranks' halves of the same Poisson batch are summed across
    processes once (by the DP optimizer, not DDP) and divided by the global batch: the same update as 1 process."""
    one, two = _one_and_two_processes(tmp_path, 0.0)
    before = tiny_vit(num_labels=10, seed=0, num_channels=1, image_size=8).state_dict()
    a, b = (ViTForImageClassification.from_pretrained(d).state_dict() for d in (one, two))
    moved = sum(float((a[k] - before[k]).abs().sum()) for k in a)
    assert moved > 0
    for k in a:
        torch.testing.assert_close(b[k] - before[k], a[k] - before[k], rtol=1e-3, atol=1e-7, msg=k)


def test_linear_probe_then_fine_tune_in_two_processes_matches_one(tmp_path):
    """LP→FT across the phase switch (step 1: head only; step 2: everything), σ = 0: both ranks switch scope at
    the same step, so 2 processes end with the 1-process weights; the embeddings moved only in phase 2."""
    one, two = _one_and_two_processes(tmp_path, 0.0, steps=2, extra=("--lp_steps", "1"))
    for d in (one, two):
        phases = json.loads((d / "privacy_ledger.json").read_text())["phases"]
        assert [(p["name"], p["steps"]) for p in phases] == [("linear_probe", 1), ("fine_tune", 1)]
    before = tiny_vit(num_labels=10, seed=0, num_channels=1, image_size=8).state_dict()
    a, b = (ViTForImageClassification.from_pretrained(d).state_dict() for d in (one, two))
    assert not torch.equal(a["vit.embeddings.patch_embeddings.projection.weight"],
                           before["vit.embeddings.patch_embeddings.projection.weight"])
    for k in a:
        torch.testing.assert_close(b[k] - before[k], a[k] - before[k], rtol=1e-3, atol=1e-7, msg=k)


def test_two_processes_report_the_single_process_eval_loss(tmp_path):
    """A BERT classifier (the text recipe, real MiniLM) evaluated in 1 and 2 processes, with nothing learnt
    (lr = 0): the same eval loss. transformers' `average_tokens_across_devices` would double it with 2 processes,
    so DPTrainingArguments turns it off."""
    recipe = ROOT / "recipes" / "dp_text_classification.py"
    args = ["--noise_multiplier", "0", "--learning_rate", "0", "--max_steps", "1", "--trainable_blocks", "0",
            "--max_train_samples", "64", "--max_eval_samples", "32", "--max_length", "32",
            "--per_device_eval_batch_size", "8", "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true"]
    _run([sys.executable, str(recipe), "--output_dir", str(tmp_path / "one"), *args])
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCEL_CONFIG),
          "--main_process_port", str(free_port()), str(recipe), "--output_dir", str(tmp_path / "two"), *args])
    one, two = (json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("one", "two"))
    assert 2.0 < one["eval_loss"] < 4.0  # a fresh 18-class head: about ln 18 = 2.89
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)
    assert two["eval_accuracy"] == one["eval_accuracy"]


# ---- a privacy unit across processes, and the logs of a 2-process recipe --------------------------------------------
@pytest.mark.slow
def test_two_processes_clip_each_unit_once(tmp_path):
    """2 processes under accelerate launch (gloo): each unit goes whole to one rank, so the σ = 0, q = 1 update
    (every unit clipped to C = 0.05, far below its gradient) equals the 1-process one and the brute-force sum of
    per-user clipped gradients. A unit split over the ranks would be clipped twice and add up to 2C."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from utils import ACCEL_CONFIG, free_port

    root = Path(__file__).resolve().parents[1]
    script = str(root / "tests" / "privacy_unit_ddp_script.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root),
           "ACCELERATE_USE_CPU": "true"}  # gloo on a CPU machine, as the recipes set it
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    for cmd in ([sys.executable, script, str(one), "6", "1"],
                [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCEL_CONFIG),
                 "--main_process_port", str(free_port()), script, str(two), "3", "1"]):
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = torch.load(one), torch.load(two)
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert a["dataset_size"] == b["dataset_size"] == 6 and a["sample_rate"] == b["sample_rate"] == 1.0
    assert norm_of_difference(a["update"], b["update"]) < 1e-5
    want = brute_force_unit_sum(user_dataset_for_script(), 0.05)
    assert norm_of_difference({n: b["update"][n] for n in want}, want) < 1e-5


def user_dataset_for_script():
    from hf_dp_repr.data import load_digits_dataset
    from privacy_unit_ddp_script import USERS as SCRIPT_USERS

    return user_dataset(load_digits_dataset(), SCRIPT_USERS)


@pytest.mark.slow
def test_two_processes_log_the_plan_and_the_results_once(tmp_path):
    """`accelerate launch` with 2 processes (gloo on CPU): the plan table, the public pre-training lines and the
    result table each appear once, not once per process."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes" / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(port),
           str(ROOT / "recipes" / "dp_image_classification.py"), "--output_dir", str(tmp_path / "o"),
           "--target_epsilon", "8", "--target_delta", "1e-4", "--public_fraction", "0.3", "--public_epochs", "2",
           "--per_device_train_batch_size", "16", "--max_steps", "2", "--max_eval_samples", "64",
           "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert out.count("DP-SGD plan (") == 1, out[-5000:]
    assert out.count("public pre-training: 431 public examples") == 1
    assert out.count("| ε spent") == 1 and out.count("| test accuracy") == 1
