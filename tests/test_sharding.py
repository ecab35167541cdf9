"""Sharded DP-SGD (FSDP2; issue 25): `DPTrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})`.

Fast, in this process: every refusal (FSDP1, offload, accelerate's FSDP and DeepSpeed switches, deepspeed=, the hooks
engine, one process without a process group, torch < 2.9) raises a typed error before any work and writes nothing;
`base_type` unwraps FSDP classes; DPTrainer over a 1-rank process group trains a sharded model (every parameter a
DTensor, no DDP wrap) to the weights of the unsharded run, and with a privacy unit clips each unit once (brute force).

Slow, ONE launch of 2 gloo processes (tests/sharded_worker.py writes results.json; timeout: a lost collective fails
instead of hanging): σ = 0 updates equal the brute-force clipped sum (GPT-2 tied, Llama, ViT, LoRA, linear probe;
flat, per_layer, automatic; accumulation; an empty micro-batch on a rank), noise std σC/L per coordinate, one example
and one unit of several rows move the update by C/L at most, DPTrainer end to end with checkpoints and an exact
resume (with ema_decay: the released average), the 1-process and 2-process runs equal with noise off, and so do
augmentation_multiplicity and probe_preconditioning runs."""

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.errors import DPConfigError, ProcessGroupError
from hf_dp_repr.training.hf_compat import HIDDEN_READS
from utils import launch_two_workers

TESTS = os.path.dirname(os.path.abspath(__file__))
V2 = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}  # copied before use: transformers edits fsdp_config in place


def _args(tmp_path, **kw):
    return DPTrainingArguments(output_dir=str(tmp_path / "never"), target_epsilon=1.0, report_to="none", **kw)


@pytest.fixture
def one_rank_group():
    """A 1-process gloo group in this process (what a sharded run needs), destroyed after the test with accelerate's
    state that it set up."""
    from accelerate.state import AcceleratorState, PartialState

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


# ---- refusals: typed, before any work, nothing written ------------------------------------------------------------
@pytest.mark.parametrize("kwargs, env, error, match", [
    ({"fsdp": True, "fsdp_config": {"fsdp_version": 1}}, {}, DPConfigError, r"version 1 \(FSDP1"),
    ({"fsdp": "full_shard offload", "fsdp_config": {"fsdp_version": 2}}, {}, DPConfigError, "'offload' is not"),
    ({**V2, "fsdp_config": {"fsdp_version": 2, "cpu_offload": True}}, {}, DPConfigError, "cpu_offload=True"),
    ({}, {"ACCELERATE_USE_FSDP": "true"}, DPConfigError, "ACCELERATE_USE_FSDP=true .*fsdp_version': 2"),
    ({}, {"ACCELERATE_USE_DEEPSPEED": "true"}, DPConfigError, "ACCELERATE_USE_DEEPSPEED=true .* use fsdp=True"),
    ({"deepspeed": {"zero_optimization": {"stage": 3}}}, {}, DPConfigError, "deepspeed=.* DeepSpeed owns the backward"),
    ({**V2, "clipping_engine": "hooks"}, {}, DPConfigError, "clipping_engine='hooks'.* Use clipping_engine='ghost'"),
    (V2, {}, ProcessGroupError, "runs alone.*accelerate_configs"),
])
def test_what_cannot_run_sharded_is_refused_before_any_work(kwargs, env, error, match, tmp_path, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error, match=match):
        _args(tmp_path, **copy.deepcopy(kwargs))
    assert not (tmp_path / "never").exists()


def test_torch_without_a_correct_gloo_reduce_scatter_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.0+cpu")
    with pytest.raises(DPConfigError, match=r"needs torch >= 2\.9; this is torch 2\.8\.0\+cpu: .*#162338"):
        _args(tmp_path, **copy.deepcopy(V2))
    assert not (tmp_path / "never").exists()
    _args(tmp_path)  # unsharded runs do not care


# Trainer methods that read a field DPTrainer hides from Trainer.__init__ (training.hf_compat.HIDDEN_READS), besides
# __init__: create_accelerator_and_postprocess runs inside __init__ (its save_only_model checks apply to accelerate's
# FSDP/DeepSpeed plugins, refused here); _save_checkpoint reads the user's value again (the optimizer is saved).
OTHER_READERS = {"fsdp": set(), "save_only_model": {"create_accelerator_and_postprocess", "_save_checkpoint"}}


@pytest.mark.parametrize("field, text, why", HIDDEN_READS)
def test_the_fields_hidden_from_trainer_init_are_read_there_and_nowhere_unexpected(field, text, why):
    import inspect
    import re

    from transformers import Trainer

    assert text in inspect.getsource(Trainer.__init__), (field, why)
    readers = {name for name, f in inspect.getmembers(Trainer, inspect.isfunction)
               if re.search(rf"args\.{field}\b", inspect.getsource(f))}
    assert readers - {"__init__"} == OTHER_READERS[field], (field, why)


def test_base_type_sees_through_fsdp_classes(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    from hf_dp_repr.privacy.sharding import base_type

    norm = torch.nn.LayerNorm(4)
    fully_shard(norm)
    assert type(norm).__name__ == "FSDPLayerNorm" and base_type(norm) is torch.nn.LayerNorm


def test_dp_trainer_shards_the_model_itself_and_trains_it_as_unsharded(one_rank_group, tmp_path):
    """Over a 1-rank group: DPTrainer shards (DTensors, no DDP), the ghost engine and the 'fsdp2' reduction run
    (LP→FT, empty micro-batches) and give the weights of the same run unsharded (σ = 0)."""
    from torch.distributed.tensor import DTensor

    from sharded_runs import vit_lp_then_ft

    trainer, weights = vit_lp_then_ft(tmp_path / "sharded", 1, sharded=True)
    assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
    assert type(trainer.model_wrapped).__name__ == "FSDPViTForImageClassification"
    assert trainer.engine.options.reduction == "fsdp2" and trainer.engine.clipping_engine == "ghost"
    _, plain = vit_lp_then_ft(tmp_path / "plain", 1, sharded=False)
    from hf_dp_repr.tiny import tiny_vit

    start = dict(tiny_vit(seed=0).named_parameters())
    assert max((plain[n] - start[n]).abs().max().item() for n in plain) > 1e-3  # it trained
    for name in plain:
        torch.testing.assert_close(weights[name], plain[name], rtol=1e-5, atol=1e-7)


def test_privacy_units_run_sharded_and_each_unit_is_clipped_once(one_rank_group, digits, tmp_path):
    """privacy_unit under fsdp (1-rank group): micro-batches of whole units ('big', 11 of the 20 rows, is never cut),
    clipped by the ghost engine; the σ = 0 update (q = 1: every unit) equals the brute-force per-unit clipped sum."""
    from hf_dp_repr import DPTrainer
    from hf_dp_repr.tiny import tiny_vit
    from utils import CaptureUpdate, brute_force_unit_sum, norm_of_difference, user_dataset

    data, capture = user_dataset(digits), CaptureUpdate()
    args = DPTrainingArguments(
        **copy.deepcopy(V2), output_dir=str(tmp_path / "units"), per_device_train_batch_size=3,
        gradient_accumulation_steps=2, max_steps=1, noise_multiplier=0.0, per_sample_max_grad_norm=2.0,
        privacy_unit="user_id", learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=3, noise_seed=3, target_delta=1e-3)
    trainer = DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args, train_dataset=data, callbacks=[capture])
    trainer.train()
    assert trainer.engine.clipping_engine == "ghost" and trainer.engine.sampler.whole_units
    assert trainer.ledger.plan.phases[0].sample_rate == 1.0 and trainer.ledger.plan.dataset_size == 6
    got = {n: g.full_tensor() * trainer.ledger.expected_batch_size for n, g in capture.grads.items()}
    want = brute_force_unit_sum(data, 2.0)
    scale = torch.sqrt(sum((w.double() ** 2).sum() for w in want.values())).item()
    assert norm_of_difference(got, want) <= 1e-4 * scale  # float32 (rows clipped one by one: off by O(1))


# ---- 2 processes: one launch -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([TESTS, env.get("PYTHONPATH", "")]))
    launch_two_workers("sharded_worker.py", out, env, timeout=300)
    with open(out / "results.json") as f:
        return json.load(f), out


@pytest.mark.slow
def test_two_processes_sigma_0_updates_equal_the_brute_force_clipped_sum(two_processes):
    results, _ = two_processes
    assert results["world_size"] == 2
    for kind, found in {**results["exact"], **{f"gpt2 {m}": r for m, r in results["modes"].items()}}.items():
        assert found["rel_err"] <= 1e-5, (kind, found)
        assert found["all_dtensor"] and found["grads_after_backward"] == 0, kind  # no unclipped gradient formed
    assert results["exact"]["gpt2"]["tied"]
    assert "classifier.weight" in results["exact"]["vit"]["uneven"]  # 3 rows over 2 ranks
    assert results["exact"]["gpt2_lora"]["tensors"] == 4 and results["exact"]["vit_lp"]["tensors"] == 2
    for kind, found in results["float64"].items():
        assert found["rel_err"] <= (1e-7 if kind == "llama" else 1e-12), kind  # LlamaRMSNorm computes in float32


@pytest.mark.slow
def test_two_processes_noise_is_sigma_c_per_coordinate_once(two_processes):
    noise = two_processes[0]["noise"]
    assert 0.95 <= noise["std_ratio"] <= 1.05 and 0.95 <= noise["own_rows_std_ratio"] <= 1.05  # not √2×, not 0
    assert not noise["ranks_share_noise"] and noise["coordinates"] > 10_000
    assert 0.9 <= two_processes[0]["one_example"]["diff_norm_over_C"] <= 1 + 1e-5  # clipped, not dropped
    unit = two_processes[0]["one_unit"]  # 3 rows of one unit on rank 0: clipped once as a whole
    assert 0.9 <= unit["diff_norm_over_C"] <= 1 + 1e-5 and unit["rows_clipped_one_by_one_over_C"] >= 2


@pytest.mark.slow
def test_two_processes_adaptive_clipping_counts_both_ranks_and_noises_once(two_processes):
    """Adaptive clipping sharded (FSDP2): every rank follows the same C, the 1-process one (its count holds every
    row; rank 0's rows alone, or a count noised on each rank, would give another C)."""
    found = two_processes[0]["adaptive"]
    assert found["ranks"][0] == found["ranks"][1]
    assert found["ranks"][0] == pytest.approx(found["one_process"], rel=1e-9)
    assert len(set(found["one_process"])) == 3  # C moved at every step


@pytest.mark.slow
def test_two_processes_dp_trainer_checkpoints_and_resume(two_processes):
    results, out = two_processes
    run = results["trainer"]
    assert run["all_dtensor"] and run["tied"] and run["reduction"] == "fsdp2"
    assert run["wrapped"] == "FSDPGPT2LMHeadModel"  # not DistributedDataParallel
    assert run["saved_max_diff"] == 0.0 and not run["distributed_config_saved"]  # a plain HF model, whole
    assert run["optimizer_full"]  # every tensor's state at full shape, not rank 0's shards
    assert {"model.safetensors", "optimizer.pt", "privacy_ledger.json", "README.md"} <= set(run["files"])
    assert run["resume_max_diff"] == 0.0 and run["resume_epsilon"] == run["epsilon"]
    assert results["lora"]["resume_max_diff"] == 0.0 and results["lora"]["adapter_shapes_full"]
    assert results["loaded_sharded"]["all_dtensor"] and results["loaded_sharded"]["reduction"] == "fsdp2"
    assert results["lp_ft"]["empty_micro_batches"] > 0 and results["lp_ft"]["phases"] == ["linear_probe", "fine_tune"]


@pytest.mark.slow
def test_two_processes_release_the_weight_average_and_resume_it_exactly(two_processes):
    """ema_decay on the 2-process GPT-2 run (σ > 0): the average is sharded as the parameters; the saved model and
    checkpoint-1's model file are the average of the whole iterates computed by hand (float32 lerp vs float64), the
    checkpoint's raw iterate is the iterate, and the resume continues both (its final average: resume_max_diff)."""
    ema = two_processes[0]["trainer"]["ema"]
    assert ema["all_dtensor"] and ema["steps"] == 2
    assert ema["saved_vs_hand"] <= 1e-6 and ema["checkpoint_vs_hand"] <= 1e-6
    assert ema["checkpoint_raw_vs_iterate"] == 0.0 and ema["raw_vs_last_iterate"] == 0.0
    assert ema["resume_raw_diff"] == 0.0 and two_processes[0]["trainer"]["resume_max_diff"] == 0.0
    assert ema["average_vs_last_iterate"] > 1e-3  # the average is not the last iterate: the checks tell them apart


@pytest.mark.slow
def test_two_processes_views_and_a_preconditioned_probe_equal_one_unsharded_process(two_processes, tmp_path):
    """σ = 0: augmentation_multiplicity=3 (each example's 3 views clipped once, on whichever rank holds it) and
    probe_preconditioning='pca:4' with ema_decay (fitted on public rows by every rank, the sharded head padded, folded
    whole for the save) give the weights of the same runs in one unsharded process; the saved model predicts as it."""
    from transformers import ViTForImageClassification

    from hf_dp_repr.data import load_digits_dataset
    from hf_dp_repr.tiny import tiny_vit
    from sharded_runs import full_weights, probe_run, views_run

    results, out = two_processes
    two = torch.load(out / "accuracy.pt", weights_only=True)
    assert results["accuracy"]["probe_head_sharded"]
    start = full_weights(tiny_vit(seed=0))
    views = views_run(tmp_path / "views", 1, sharded=False)
    assert max((views[n] - start[n]).abs().max().item() for n in views) > 1e-3  # it trained
    for name in views:
        torch.testing.assert_close(two["views"][name], views[name], rtol=1e-5, atol=1e-7)
    probe = probe_run(tmp_path / "probe", 1, sharded=False)
    one = full_weights(probe.model)
    assert (one["classifier.weight"] - start["classifier.weight"]).abs().max() > 1e-2  # it trained
    saved = ViTForImageClassification.from_pretrained(out / "probe")  # a plain model, its head folded
    for name, p in saved.named_parameters():
        torch.testing.assert_close(two["probe"][name], one[name], rtol=1e-4, atol=1e-6)
        assert torch.equal(p, two["probe"][name]), name
    pixels = load_digits_dataset()["test"].select(range(16))[:]["pixel_values"]
    with torch.no_grad():
        torch.testing.assert_close(saved(pixel_values=pixels).logits, probe.model(pixel_values=pixels).logits,
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_weights_with_noise_off(two_processes, one_rank_group, tmp_path):
    from sharded_runs import vit_lp_then_ft

    two = torch.load(two_processes[1] / "vit_lp_ft.pt", weights_only=True)
    _, one = vit_lp_then_ft(tmp_path / "one", 1, sharded=True)
    for name in two:
        torch.testing.assert_close(one[name], two[name], rtol=1e-5, atol=1e-7)


def test_a_sharded_run_pushes_a_plain_model_its_ledger_and_card(one_rank_group, tmp_path, digits, hub):
    from huggingface_hub import HfApi, ModelCard
    from torch.distributed.tensor import DTensor
    from transformers import ViTForImageClassification

    from hf_dp_repr import DPTrainer
    from hf_dp_repr.tiny import tiny_vit

    repo = "someone/dp-sharded"
    args = DPTrainingArguments(output_dir=str(tmp_path / "run"), noise_multiplier=0.55, target_delta=1e-4, max_steps=1,
                               per_device_train_batch_size=16, report_to="none", save_strategy="no", disable_tqdm=True,
                               push_to_hub=True, hub_model_id=repo, **copy.deepcopy(V2))
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])
    trainer.train()
    trainer.push_to_hub()
    files = set(HfApi().list_repo_files(repo))
    assert {"README.md", "config.json", "model.safetensors", "privacy_ledger.json"} <= files
    assert not files & {"optimizer.pt", "training_args.bin", "trainer_state.json"}
    pushed = ViTForImageClassification.from_pretrained(repo)  # a plain HF model, whole
    live = {n: p.full_tensor() for n, p in trainer.model.named_parameters() if isinstance(p, DTensor)}
    assert len(live) == len(dict(pushed.named_parameters()))
    for name, p in pushed.named_parameters():
        assert torch.equal(p, live[name]), name
    assert "differential-privacy" in ModelCard.load(repo).data.tags


def test_a_model_the_ghost_engine_cannot_clip_is_refused_before_it_is_sharded(one_rank_group, tmp_path, digits):
    from torch.distributed.tensor import DTensor

    from hf_dp_repr import DPTrainer
    from hf_dp_repr.tiny import tiny_vit

    model = tiny_vit()
    model.gradient_checkpointing_enable()  # on the model, not in the arguments (those are refused earlier)
    args = DPTrainingArguments(output_dir=str(tmp_path / "never"), target_epsilon=1.0, report_to="none",
                               **copy.deepcopy(V2))
    with pytest.raises(DPConfigError, match="cannot clip this model exactly: gradient checkpointing.*without fsdp"):
        DPTrainer(model=model, args=args, train_dataset=digits["train"])
    assert not any(isinstance(p, DTensor) for p in model.parameters()) and not (tmp_path / "never").exists()


def test_a_sharded_resume_from_a_checkpoint_missing_a_tensor_is_refused(one_rank_group, tmp_path, digits):
    from safetensors.torch import load_file, save_file

    from hf_dp_repr import DPTrainer
    from hf_dp_repr.errors import CheckpointMismatchError
    from hf_dp_repr.tiny import tiny_vit

    def trainer():
        args = DPTrainingArguments(output_dir=str(tmp_path / "run"), noise_multiplier=0.55, target_delta=1e-4,
                                   max_steps=2, per_device_train_batch_size=16, report_to="none",
                                   save_strategy="steps", save_steps=1, disable_tqdm=True, **copy.deepcopy(V2))
        return DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"])

    trainer().train()
    weights = tmp_path / "run" / "checkpoint-1" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["classifier.bias"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match="classifier.bias"):
        trainer().train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))


@pytest.mark.parametrize("optim, state", [("sgd", "empty"), pytest.param("sgd", "momentum", marks=pytest.mark.slow),
                                          pytest.param("adamw_torch", "moments", marks=pytest.mark.slow)])
def test_a_sharded_run_resumes_exactly_whatever_its_optimizer_state(optim, state, one_rank_group, tmp_path):
    """Plain SGD keeps no state: the resume failed in torch's set_optimizer_state_dict ('Expected device to be
    set'). Every optimizer, with an empty state or not, resumes to the weights and ε of the run straight through
    (checked with 2 gloo processes too, by hand: plain SGD and SGD with momentum, max |Δw| = 0, the same ε). The
    plain SGD case also keeps the weights gathered after forward (reshard_after_forward=False): the forward of train()'s
    start-of-training probe left them on the modules, and loading the checkpoint into them failed (mixed Tensor and
    DTensor)."""
    from sharded_runs import gpt2_run

    kw = {"optim": optim, "optim_args": "momentum=0.9" if state == "momentum" else None}
    if state == "empty":
        kw["fsdp_config"] = {"fsdp_version": 2, "reshard_after_forward": False}
    straight, weights = gpt2_run(tmp_path / "straight", 1, **kw)
    resumed, again = gpt2_run(tmp_path / "resumed", 1, resume=str(tmp_path / "straight" / "checkpoint-1"), **kw)
    assert all(torch.equal(again[n], weights[n]) for n in weights)
    assert resumed.epsilon() == straight.epsilon() and resumed.ledger.steps_done == 2
    saved = torch.load(tmp_path / "straight" / "checkpoint-1" / "optimizer.pt", weights_only=True)
    assert bool(saved["state"]) == (state != "empty")  # the states were what the case says


def test_load_best_model_at_end_restores_the_best_checkpoint_sharded(one_rank_group, tmp_path):
    """load_best_model_at_end on a sharded model: after training, the weights are the best checkpoint's (not the last
    step's), restored into the DTensors."""
    from safetensors.torch import load_file

    from hf_dp_repr import DPTrainer
    from hf_dp_repr.tiny import tiny_gpt2
    from sharded_runs import _args, full_weights
    from utils import make_token_dataset

    args = _args(tmp_path / "best", 1, True, noise_multiplier=5.0, max_steps=4, optim="adamw_torch", save_steps=1,
                 save_strategy="steps", eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
                 metric_for_best_model="eval_loss")
    trainer = DPTrainer(model=tiny_gpt2(seed=0), args=args, train_dataset=make_token_dataset(n=48),
                        eval_dataset=make_token_dataset(n=16, seed=5))  # held-out rows
    trainer.train()
    losses = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    best = trainer.state.best_model_checkpoint
    assert best.endswith(f"checkpoint-{min(losses, key=losses.get)}") and not best.endswith("checkpoint-4"), losses
    saved, now = load_file(os.path.join(best, "model.safetensors")), full_weights(trainer.model)
    assert all(torch.equal(now[name], saved[name]) for name in saved)
