"""Several processes under `accelerate launch` (gloo on CPU), against the same run in 1 process.

A real 2-process run of the image recipe: with σ = 1000 the noise dominates the clipped gradient sum (at most
B·C = 32 against a noise norm of σ·C·√P ≈ 3.7e5), so one SGD step's update Δ = −lr·(Σ clip(g_i) + N(0, σ²C²)) / B
has a per-coordinate std of lr·σ·C/B. Noise added once per logical batch gives the same std with 1 or 2 processes;
noise added on every process would give √2 times more with 2 (2 times if the ranks drew the same noise), and dividing
by the per-process batch would give 2 times more. (Both runs pass the same `noise_seed`, so rank 0 draws the noise
the single process draws, and the two updates are in fact nearly identical.) Also: a privacy unit is clipped once
across ranks, the recipes log the plan and the results once, and the LM recipe runs sharded (FSDP2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import ViTForImageClassification

from ddp_worker import GLOBAL_BATCH, LR, SIGMA
from hf_dp_repr.tiny import tiny_vit
from utils import brute_force_unit_sum, launch_two_workers, norm_of_difference, printed_by_ranks, user_dataset

pytestmark = pytest.mark.slow  # several processes under accelerate launch

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of tests/ddp_worker.py in 1 process, then in ONE `accelerate launch` of 2: (one, two) folders."""
    base = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)  # as a user's launch: test_a_users_own_script_under_accelerate_launch_...
    proc = subprocess.run([sys.executable, str(TESTS / "ddp_worker.py"), str(base / "one")], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    launch_two_workers("ddp_worker.py", base / "two", env, timeout=600, accelerate=True)
    return base / "one", base / "two"


def _initial_weights() -> dict:
    return tiny_vit(num_labels=10, seed=0, num_channels=1, image_size=8).state_dict()


def _update_std(out: Path) -> float:
    """Std over all coordinates of (weights after one step − initial weights) / lr."""
    before = _initial_weights()
    after = ViTForImageClassification.from_pretrained(out).state_dict()
    assert set(after) == set(before)
    deltas = [(after[k] - before[k]).flatten() for k in after]
    return float(torch.cat(deltas).std() / LR)


def test_two_processes_account_the_global_logical_batch(runs):
    one, two = (json.loads((d / "noise" / "privacy_ledger.json").read_text()) for d in runs)
    assert two["world_size"] == 2 and one["world_size"] == 1
    for led in (one, two):
        (phase,) = led["phases"]
        assert phase["expected_batch_size"] == GLOBAL_BATCH  # per device 16 × accumulation 1 × 2 processes
        assert phase["sample_rate"] == pytest.approx(GLOBAL_BATCH / led["dataset_size"])
        assert led["steps_done"] == 1
    assert two["epsilon"] == pytest.approx(one["epsilon"])  # same history → same accountant ε


def test_noise_is_added_once_per_update_not_once_per_process(runs):
    std_one, std_two = (_update_std(d / "noise") for d in runs)
    expected = SIGMA * 1.0 / GLOBAL_BATCH  # σ·C/B with C = 1
    assert std_one == pytest.approx(expected, rel=0.02)
    ratio = std_two / std_one
    print(f"update std: 1 process {std_one:.3f}, 2 processes {std_two:.3f}, ratio {ratio:.4f} (√2 = 1.414)")
    assert ratio == pytest.approx(1.0, abs=0.03), f"ratio {ratio:.3f}: noise is not added once per logical batch"


def _assert_same_update(one: Path, two: Path, before: dict) -> None:
    a, b = (ViTForImageClassification.from_pretrained(d).state_dict() for d in (one, two))
    for k in a:
        torch.testing.assert_close(b[k] - before[k], a[k] - before[k], rtol=1e-3, atol=1e-7, msg=k)


def test_without_noise_two_processes_make_the_single_process_update(runs):
    """σ = 0: the clipped per-example gradients of both ranks' halves of the same Poisson batch are summed across
    processes once (by the DP optimizer, not DDP) and divided by the global batch: the same update as 1 process."""
    one, two = (d / "exact" for d in runs)
    before = _initial_weights()
    a = ViTForImageClassification.from_pretrained(one).state_dict()
    assert sum(float((a[k] - before[k]).abs().sum()) for k in a) > 0
    _assert_same_update(one, two, before)


def test_linear_probe_then_fine_tune_in_two_processes_matches_one(runs):
    """LP→FT across the phase switch (step 1: head only; step 2: everything), σ = 0: both ranks switch scope at
    the same step, so 2 processes end with the 1-process weights; the embeddings moved only in phase 2."""
    one, two = (d / "lpft" for d in runs)
    for d in (one, two):
        phases = json.loads((d / "privacy_ledger.json").read_text())["phases"]
        assert [(p["name"], p["steps"]) for p in phases] == [("linear_probe", 1), ("fine_tune", 1)]
    before = _initial_weights()
    a = ViTForImageClassification.from_pretrained(one).state_dict()
    assert not torch.equal(a["vit.embeddings.patch_embeddings.projection.weight"],
                           before["vit.embeddings.patch_embeddings.projection.weight"])
    _assert_same_update(one, two, before)


def test_adaptive_clipping_in_two_processes_follows_the_single_process_c(runs):
    """Adaptive clipping (σ = 1, σ_b = 2, same noise_seed): the count is summed over both ranks' examples and noised
    once (rank 0, the single process's draw), so the two runs follow the same C; the ledger states σ_b and σ_eff."""
    one, two = (json.loads((d / "adaptive" / "privacy_ledger.json").read_text()) for d in runs)
    assert len(one["clip_norms"]) == 3 and len(set(one["clip_norms"])) == 3
    assert two["clip_norms"] == pytest.approx(one["clip_norms"], rel=1e-6)
    assert two["adaptive_clipping"]["count_noise"] == 2.0
    assert two["gradient_noise_multipliers"] == pytest.approx([(1.0 - 1 / 16) ** -0.5])


def test_two_processes_report_the_single_process_eval_loss(runs):
    """A BERT classifier (the text recipe, real MiniLM) evaluated in 1 and 2 processes, with nothing learnt
    (lr = 0): the same eval loss. transformers' `average_tokens_across_devices` would double it with 2 processes,
    so DPTrainingArguments turns it off."""
    one, two = (json.loads((d / "eval" / "all_results.json").read_text()) for d in runs)
    assert 2.0 < one["eval_loss"] < 4.0  # a fresh 18-class head: about ln 18 = 2.89
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)
    assert two["eval_accuracy"] == one["eval_accuracy"]


# ---- a privacy unit across processes, and the logs of a 2-process recipe --------------------------------------------
def test_two_processes_clip_each_unit_once(runs):
    """2 processes under accelerate launch (gloo): each unit goes whole to one rank, so the σ = 0, q = 1 update
    (every unit clipped to C = 0.05, far below its gradient) equals the 1-process one and the brute-force sum of
    per-user clipped gradients. A unit split over the ranks would be clipped twice and add up to 2C."""
    a, b = (torch.load(d / "unit.pt") for d in runs)
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert a["dataset_size"] == b["dataset_size"] == 6 and a["sample_rate"] == b["sample_rate"] == 1.0
    assert norm_of_difference(a["update"], b["update"]) < 1e-5
    want = brute_force_unit_sum(user_dataset_for_script(), 0.05)
    assert norm_of_difference({n: b["update"][n] for n in want}, want) < 1e-5


def user_dataset_for_script():
    from hf_dp_repr.data import load_digits_dataset
    from privacy_unit_ddp_script import USERS as SCRIPT_USERS

    return user_dataset(load_digits_dataset(), SCRIPT_USERS)


def test_two_processes_log_the_plan_and_the_results_once(runs):
    """`accelerate launch` with 2 processes (gloo on CPU), the image recipe at ε = 8 with public pre-training: the
    plan table, the public pre-training lines and the result table each appear once over both processes' output, not
    once per process."""
    out = printed_by_ranks(runs[1] / "logs", "logs")
    assert out.count("DP-SGD plan (") == 1, out[-5000:]
    assert out.count("public pre-training: 431 public examples") == 1
    assert out.count("| ε spent") == 1 and out.count("| test accuracy") == 1


def test_a_users_own_script_under_accelerate_launch_is_one_run(runs):
    """cpu_2proc.yaml on a user's script that does not set ACCELERATE_USE_CPU (tests/one_run_user_script.py, the
    launch's first run): before, each process saw a world of 1 and rank 0 of its own, trained alone and saved; now
    the two are one run: one world of 2, one saver, one ledger for 2 processes, one plan printed
    (log_level="info")."""
    user = runs[1] / "user"
    seen = [json.loads((user / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["world_size"] for s in seen] == [2, 2] and [s["process_index"] for s in seen] == [0, 1]
    assert [s["should_save"] for s in seen] == [True, False]
    assert json.loads((user / "privacy_ledger.json").read_text())["world_size"] == 2
    out = printed_by_ranks(runs[1] / "logs", "user")
    assert out.count("DP-SGD plan (") == 1, out[-5000:]


def test_the_lm_recipe_runs_sharded_under_accelerate_launch(runs):
    """The README's launch: `accelerate launch cpu_2proc.yaml recipes/dp_causal_lm.py --fsdp full_shard --fsdp_config
    '{"fsdp_version": 2}'` (here the recipe's main in the shared launch) trains the documents (units) sharded, not as
    DDP, and ends with the result table and the DP model's sample: every process joins the sample's generate (a
    rank-0-only forward of a sharded model hung up the other rank and failed the run)."""
    log = printed_by_ranks(runs[1] / "logs", "lm")
    assert "FSDP2: sharded over 2 processes" in log and log.count("| sample (greedy, DP model)") == 1, log[-5000:]
    out = runs[1] / "lm"
    ledger = json.loads((out / "privacy_ledger.json").read_text())
    assert ledger["steps_done"] == 2 and ledger["privacy_unit"] == "document_id" and ledger["world_size"] == 2
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
