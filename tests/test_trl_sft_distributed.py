"""DPSFTTrainer on 2 processes (gloo on CPU), DDP and FSDP2, in ONE launch (tests/trl_sft_worker.py), against the same
runs in this process: with σ = 0 and q = 1 the 2-process update (each rank clips its own conversations, or its own
users' conversations, and the DP optimizer sums the clipped sums once) equals the 1-process one; with σ = 300 the
update's std per coordinate is σC/L once (noise added once per logical batch, not once per process). Also the
recipe under `accelerate launch --fsdp`: DP LoRA SFT over users, sharded, then generate() from the saved model."""

import json
import os
from pathlib import Path

import pytest
import torch

from utils import launch_two_workers, printed_by_ranks

pytestmark = pytest.mark.slow  # several processes

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_two")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
    launch_two_workers("trl_sft_worker.py", out, env, timeout=400, accelerate=True)
    runs = {name: torch.load(out / f"{name}.pt") for name in ("ddp", "fsdp_users", "ddp_noisy")}
    return {**runs, "recipe": out / "recipe", "recipe_log": printed_by_ranks(out / "logs", "recipe")}


def one_process(name, tmp_path):
    from trl_sft_worker import run

    return run(name, str(tmp_path), 1)


@pytest.mark.parametrize("name", ["ddp", "fsdp_users"])
def test_two_processes_sigma0_update_equals_one_process(name, two_processes, tmp_path):
    got = two_processes[name]
    assert got["sharded"] == (name == "fsdp_users") and got["engine"] == ("ghost" if "fsdp" in name else got["engine"])
    trainer, want = one_process(name, tmp_path)
    assert got["expected_batch"] == trainer.ledger.plan.phases[0].expected_batch_size
    from hf_dp_repr.tiny import tiny_llama

    start = dict(tiny_llama(vocab_size=trainer.model.config.vocab_size, seed=1).named_parameters())
    assert max((want[n] - start[n]).abs().max().item() for n in want) > 1e-4  # it trained
    for n in want:
        torch.testing.assert_close(got["weights"][n] - start[n], want[n] - start[n], rtol=1e-3, atol=1e-6, msg=n)


def test_two_processes_add_the_noise_once_per_step(two_processes):
    from hf_dp_repr.tiny import tiny_llama

    got = two_processes["ddp_noisy"]
    weights = got["weights"]
    start = dict(tiny_llama(vocab_size=weights["lm_head.weight"].shape[0], seed=1).named_parameters())
    deltas = torch.cat([(weights[n] - start[n].detach()).flatten() for n in weights])
    assert float(deltas.std()) / 1e-3 == pytest.approx(300.0 / got["expected_batch"] * 2 ** 0.5, rel=0.03)


def test_the_sft_recipe_runs_sharded_under_accelerate_launch(two_processes):
    """The docs' launch (the shared `accelerate launch` ran the recipe last): 2 CPU processes, FSDP2, LoRA, users as
    units; the saved model answers once (rank 0)."""
    out, log = two_processes["recipe"], two_processes["recipe_log"]
    assert "FSDP2: sharded over 2 processes" in log and log.count("| answer (greedy, saved DP model)") == 1, log[-3000:]
    ledger = json.loads((out / "privacy_ledger.json").read_text())
    assert ledger["steps_done"] == 2 and ledger["privacy_unit"] == "user_id" and ledger["world_size"] == 2
    card = (out / "README.md").read_text()
    assert "| one training example | one conversation" in card and "| tokens the loss saw | the assistant's" in card
    saved = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "chat_template.jinja"} <= saved
