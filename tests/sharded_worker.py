"""The sharded (FSDP2) DP-SGD checks that need several processes, in ONE launch (each launch costs ~10 s):

    python -m torch.distributed.run --nproc_per_node 2 tests/sharded_worker.py OUT_DIR

Every rank runs every check (the collectives need all of them); rank 0 writes OUT_DIR/results.json, which
tests/test_sharding.py reads and asserts on. Run with one process it gives the 1-process sharded numbers."""

import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_dp_repr.privacy.adaptive_clipping import AdaptiveClipping  # noqa: E402
from hf_dp_repr.privacy.clipping_modes import clip_factors  # noqa: E402
from hf_dp_repr.privacy.engine import DPEngine, EngineOptions  # noqa: E402
from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine  # noqa: E402
from hf_dp_repr.privacy.ledger import Phase, PrivacyPlan  # noqa: E402
from hf_dp_repr.privacy.loss import per_example_loss  # noqa: E402
from hf_dp_repr.privacy.randomness import DPRandomness  # noqa: E402
from hf_dp_repr.privacy.reduction import NoisySum, own_rows, sharded  # noqa: E402
from hf_dp_repr.privacy.sharding import parameter_keys, shard_model  # noqa: E402
from hf_dp_repr.tiny import tiny_gpt2, tiny_llama, tiny_vit  # noqa: E402

hf_logging.set_verbosity_error()
OUT = sys.argv[1]
dist.init_process_group("gloo")
R, W = dist.get_rank(), dist.get_world_size()
RESULTS = {"world_size": W}
# Rows of each micro-batch of one logical step (rank 0's, then rank 1's): rank 1's second micro-batch is empty.
SPLIT = [(3, 2), (2, 0)] if W == 2 else [(5,), (2,)]
SEQ = 8


# ---- models, data, brute force --------------------------------------------------------------------------------
def make(kind: str, dtype=torch.float32):
    if kind == "gpt2":
        model = tiny_gpt2(seed=0)
    elif kind == "llama":
        model = tiny_llama(seed=0)
    elif kind in ("vit", "vit_lp"):
        model = tiny_vit(seed=0, num_labels=3)  # 3 labels: the classifier's rows split unevenly over 2 ranks
        if kind == "vit_lp":
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("classifier"))
    elif kind == "gpt2_lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(tiny_gpt2(seed=0), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                             lora_dropout=0.0, init_lora_weights=False))
    return model.to(dtype)


def batch(kind: str, n: int, gen: torch.Generator, dtype=torch.float32):
    if kind.startswith("vit"):
        return {"pixel_values": torch.randn(n, 1, 8, 8, generator=gen).to(dtype)}, torch.randint(0, 3, (n,),
                                                                                                   generator=gen)
    ids = torch.randint(1, 120, (n, SEQ), generator=gen)
    return {"input_ids": ids}, ids.clone()


def losses(model, kind, inputs, labels):
    inputs = dict(inputs)
    if "input_ids" in inputs:
        inputs["position_ids"] = torch.arange(SEQ).expand(len(labels), -1)
    return per_example_loss(model(**inputs).logits, labels, shift_labels=not kind.startswith("vit"))


def rows_of(x, y, lo, hi):
    return {k: v[lo:hi] for k, v in x.items()}, y[lo:hi]


def brute_force(model, kind, micro_batches, clip_norm, mode="flat"):
    """Σ_i clip(g_i) over every example of the step, one process, per-example gradients one by one: {name: sum}."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    grads = []
    for x, y in micro_batches:
        for i in range(len(y)):
            xs, ys = rows_of(x, y, i, i + 1)
            grads.append(torch.autograd.grad(losses(model, kind, xs, ys).sum(), params))
    norms = torch.stack([torch.stack([g.double().norm() for g in gs]) for gs in grads])
    exact = params[0].dtype == torch.float64  # float64 factors then, as the float64 check computes them
    factors = clip_factors(mode, norms if exact else norms.float(), clip_norm).double()
    return {n: sum(factors[i, j] * gs[j].double() for i, gs in enumerate(grads)) for j, n in enumerate(names)}


def my_rows(split, rank):
    lo = sum(split[:rank])
    return lo, lo + split[rank]


def rel_err(got: dict, ref: dict) -> float:
    err = max((got[n].double() - ref[n]).abs().max().item() for n in ref)
    return err / max(r.abs().max().item() for r in ref.values())


def plan_for(sigma, clip_norm, mode, batch_size, steps=1, unit="row"):
    return PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=clip_norm, clipping=mode,
                       dataset_size=10 * batch_size, poisson_sampling=True, world_size=W, randomness="seeded",
                       phases=[Phase("train", sigma, 0.1, steps, batch_size)], privacy_unit=unit)


def engine_step(model, kind, micro_batches, clip_norm, sigma=0.0, mode="flat", noise_seed=0, splits=None, units=None):
    """One DP step of the real engine (ghost clipper, MicroBatchDPOptimizer, "fsdp2" reduction) on the sharded
    model, this rank's rows of each micro-batch (`splits`: rows per rank of each; `units`: each row's unit id, per
    micro-batch, or None: rows); returns ({name: full released gradient × L}, grads seen after backward, this
    rank's own rows of the released gradient × L, flattened)."""
    total = sum(len(y) for _, y in micro_batches)
    engine = DPEngine(plan_for(sigma, clip_norm, mode, total, unit="row" if units is None else "document_id"),
                      EngineOptions(clipping_engine="ghost", rank=R, micro_batches_per_step=len(micro_batches),
                                    reduction="fsdp2"), DPRandomness(noise_seed=noise_seed, world_size=W))
    optimizer = engine.start(torch.optim.SGD(model.parameters(), lr=0.0), model)
    leaked = 0
    for k, ((x, y), split) in enumerate(zip(micro_batches, splits or SPLIT)):
        engine.enter_phase()
        lo, hi = my_rows(split, R)
        stand_in = hi == lo
        lo, hi = (0, 1) if stand_in else (lo, hi)
        xs, ys = rows_of(x, y, lo, hi)
        with engine.recording(len(ys)):
            losses(model, kind, xs, ys).sum().backward()
        leaked += sum(p.grad is not None for p in model.parameters())
        engine.after_backward(None if units is None else units[k][lo:hi], stand_in=stand_in)
    optimizer.step()
    grads = {n: p.grad.full_tensor() * total for n, p in model.named_parameters() if p.requires_grad}
    local = torch.cat([p.grad.to_local().flatten() for p in model.parameters() if p.requires_grad]) * total
    optimizer.zero_grad(set_to_none=True)
    engine.detach(model)
    return grads, leaked, local


def split_batches(kind, gen, dtype=torch.float32):
    return [batch(kind, sum(split), gen, dtype) for split in SPLIT]


# ---- 1. σ = 0: the sharded update equals the one-process brute force -------------------------------------------
def check_exact(kind, mode="flat"):
    gen = torch.Generator().manual_seed(1)
    micro_batches = split_batches(kind, gen)
    base = make(kind)
    ref_model = copy.deepcopy(base)
    norms = []
    for x, y in micro_batches:  # C = the median per-example norm: some examples clipped, some not
        params = [p for p in ref_model.parameters() if p.requires_grad]
        for i in range(len(y)):
            g = torch.autograd.grad(losses(ref_model, kind, *rows_of(x, y, i, i + 1)).sum(), params)
            norms.append(torch.cat([t.flatten() for t in g]).norm().item())
    clip_norm = sorted(norms)[len(norms) // 2]
    ref = brute_force(ref_model, kind, micro_batches, clip_norm, mode)
    model = copy.deepcopy(base)
    groups = shard_model(model)
    got, leaked, _ = engine_step(model, kind, micro_batches, clip_norm, mode=mode)
    return {"rel_err": rel_err(got, ref), "grads_after_backward": leaked, "groups": len(groups),
            "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            "uneven": [n for n, p in model.named_parameters() if p.shape[0] % W],
            "tied": bool(kind == "gpt2" and model.lm_head.weight is model.transformer.wte.weight),
            "tensors": len(ref)}


def check_exact_float64(kind):
    """The same in float64 with the engine's pieces (clip factors in float64: the optimizer's are float32)."""
    gen = torch.Generator().manual_seed(1)
    micro_batches = split_batches(kind, gen, torch.float64)
    base = make(kind, torch.float64)
    ref = brute_force(copy.deepcopy(base), kind, micro_batches, 1.0)
    model = copy.deepcopy(base)
    shard_model(model)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ghost = GhostClippingEngine(model, key_of=parameter_keys(model))
    kept = {}
    for (x, y), split in zip(micro_batches, SPLIT):
        lo, hi = my_rows(split, R)
        xs, ys = rows_of(x, y, 0, 1) if hi == lo else rows_of(x, y, lo, hi)
        with ghost.recording(len(ys)):
            losses(model, kind, xs, ys).sum().backward()
        sq = ghost.squared_norms()
        norms = torch.stack([sq[p] for p in trained.values()], 1).sum(1).clamp(min=0).sqrt()
        factors = (1.0 / (norms + 1e-6)).clamp(max=1) * (1.0 if hi > lo else 0.0)
        for p, total in ghost.each_clipped_sum({p: factors for p in trained.values()}):
            kept[p] = kept.get(p, 0) + own_rows(p, total)
    ghost.remove()
    params = list(trained.values())
    out = sharded(NoisySum(params, [kept[p] for p in params], 0.0, 1.0, 1, None, rank=R, world_size=W))
    return {"rel_err": rel_err({n: g.full_tensor() for n, g in zip(trained, out)}, ref)}


# ---- 2. noise: once per coordinate, σC/L per coordinate --------------------------------------------------------
def check_noise():
    sigma, clip_norm = 1000.0, 1.0
    gen = torch.Generator().manual_seed(2)
    micro_batches = split_batches("gpt2", gen)
    model = make("gpt2")
    shard_model(model)
    got, _, local = engine_step(model, "gpt2", micro_batches, clip_norm, sigma=sigma, noise_seed=5)
    flat = torch.cat([g.flatten() for g in got.values()]).double()  # the update × L: Σ clipped + noise
    mine = local.flatten().double()
    others = [torch.zeros_like(mine) for _ in range(W)]
    dist.all_gather(others, mine)
    same = W > 1 and len({t.numel() for t in others}) == 1 and bool(torch.equal(others[0], others[1]))
    return {"std_ratio": (flat.std() / (sigma * clip_norm)).item(), "own_rows_std_ratio":
            (mine.std() / (sigma * clip_norm)).item(), "coordinates": flat.numel(), "ranks_share_noise": same}


# ---- 3. one example far beyond C moves the σ = 0 update by C/L at most ------------------------------------------
def check_one_example():
    """An extra row on rank 0, scaled ×1000 (its gradient norm ≫ C): the σ = 0 step with and without it (same L)
    differs by C at most (and by nearly C: it is clipped, not dropped)."""
    clip_norm = 1.0
    gen = torch.Generator().manual_seed(3)
    with_it = split_batches("vit", gen)
    with_it[0][0]["pixel_values"][0] *= 1000.0
    (x, y), rest = with_it[0], with_it[1:]
    without = [rows_of(x, y, 1, len(y))] + rest
    grads = []
    for mbs, splits in ((without, [(SPLIT[0][0] - 1, *SPLIT[0][1:])] + SPLIT[1:]), (with_it, SPLIT)):
        model = make("vit")
        shard_model(model)
        grads.append(engine_step(model, "vit", mbs, clip_norm, splits=splits)[0])
    diff = torch.cat([(grads[1][n] - grads[0][n]).flatten() for n in grads[0]]).double()
    return {"diff_norm_over_C": (diff.norm() / clip_norm).item()}


# ---- 3b. one unit of several rows far beyond C moves it by C/L at most: clipped once, as a whole ---------------
def check_one_unit():
    """Rank 0's 3 rows of the first micro-batch are one unit (nearly the same image ×1000, same label: its rows'
    gradients nearly parallel, each ≫ C); every other row is a unit of its own. The σ = 0 step (× L) with and without
    that unit differs by C at most, and by nearly C; clipping its rows one by one would move it by nearly 3C (measured
    here too, on the same data, so the check is known to tell the two apart)."""
    clip_norm, size = 1.0, 3
    gen = torch.Generator().manual_seed(4)
    with_it = split_batches("vit", gen)
    x, y = with_it[0]
    noise = torch.randn(size, *x["pixel_values"].shape[1:], generator=gen)
    x["pixel_values"][:size] = 1000.0 * (x["pixel_values"][0] + 0.01 * noise)
    y[:size] = y[0]
    units = [torch.arange(len(b[1])) + 100 * k for k, b in enumerate(with_it)]  # one unit per row ...
    units[0][:size] = -1  # ... but the unit of rank 0's first 3 rows
    without = [rows_of(x, y, size, len(y))] + with_it[1:]
    runs = ((without, [(SPLIT[0][0] - size, *SPLIT[0][1:])] + SPLIT[1:], [units[0][size:]] + units[1:]),
            (with_it, SPLIT, units), (with_it, SPLIT, None))  # the last: its rows clipped one by one
    grads = []
    for mbs, splits, ids in runs:
        model = make("vit")
        shard_model(model)
        grads.append(engine_step(model, "vit", mbs, clip_norm, splits=splits, units=ids)[0])

    def moved(k):
        return torch.cat([(grads[k][n] - grads[0][n]).flatten() for n in grads[0]]).double().norm().item() / clip_norm

    return {"diff_norm_over_C": moved(1), "rows_clipped_one_by_one_over_C": moved(2)}


# ---- 3c. adaptive clipping: the count summed over the ranks, noised once ------------------------------------------
def check_adaptive():
    """3 steps (lr 0, σ_b = 0.5) of adaptive clipping on the sharded GPT-2 and on the unsharded one in this process
    alone (world_size 1, every row): the same C sequence on every rank (the count of both ranks' rows, its noise
    drawn once, from the step's count stream of the shared secret) as the single process."""
    micro_batches = split_batches("gpt2", torch.Generator().manual_seed(6))
    total = sum(len(y) for _, y in micro_batches)

    def run(world):
        model = make("gpt2")
        if world > 1:
            shard_model(model)
        plan = PrivacyPlan(accountant="rdp", target_delta=1e-5, per_sample_max_grad_norm=1.0, clipping="flat",
                           dataset_size=10 * total, poisson_sampling=True, world_size=world, randomness="seeded",
                           phases=[Phase("train", 0.5, 0.1, 3, total)],
                           adaptive_clipping=AdaptiveClipping(0.5, 1.0, count_noise=0.5))
        engine = DPEngine(plan, EngineOptions(clipping_engine="ghost", rank=R if world > 1 else 0,
                                              micro_batches_per_step=len(micro_batches),
                                              reduction="fsdp2" if world > 1 else "ddp"),
                          DPRandomness(noise_seed=7, world_size=world))
        optimizer = engine.start(torch.optim.SGD(model.parameters(), lr=0.0), model)
        for _ in range(3):
            for (x, y), split in zip(micro_batches, SPLIT):
                engine.enter_phase()
                lo, hi = my_rows(split, R) if world > 1 else (0, len(y))
                stand_in = hi == lo
                xs, ys = rows_of(x, y, *((0, 1) if stand_in else (lo, hi)))
                with engine.recording(len(ys)):
                    losses(model, "gpt2", xs, ys).sum().backward()
                engine.after_backward(stand_in=stand_in)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        engine.detach(model)
        return list(engine.ledger.clip_norms)

    sharded_norms = run(W)
    every_rank = [None] * W
    dist.all_gather_object(every_rank, sharded_norms)
    return {"ranks": every_rank, "one_process": run(1)}


# ---- 4. DPTrainer: fsdp=True, checkpoints, resume, LP→FT, LoRA, a model sharded at load ----------------------
EMA_DECAY = 0.9


def check_trainer():
    """The Trainer's switch end to end (tiny GPT-2, tied, AdamW, σ > 0 with noise_seed, accumulation 2, a checkpoint
    each step, ema_decay: what is saved is the average), then a resume from checkpoint-1: the same weights and ε as
    straight through."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from sharded_runs import Iterates, gpt2_run

    out, iterates = os.path.join(OUT, "gpt2"), Iterates()
    trainer, weights = gpt2_run(out, W, ema_decay=EMA_DECAY, callbacks=[iterates])
    model = trainer.model
    result = {"wrapped": type(trainer.model_wrapped).__name__, "epsilon": trainer.epsilon(),
              "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
              "tied": model.lm_head.weight is model.transformer.wte.weight,
              "reduction": trainer.engine.options.reduction}
    resumed, again = gpt2_run(os.path.join(OUT, "gpt2_resumed"), W, resume=os.path.join(out, "checkpoint-1"),
                              ema_decay=EMA_DECAY)
    result["resume_max_diff"] = max((again[n] - weights[n]).abs().max().item() for n in weights)
    result["resume_epsilon"] = resumed.epsilon()
    result["ema"] = check_average(trainer, resumed, iterates.seen, out)
    if R == 0:
        saved = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final"))
        result["saved_max_diff"] = max((p - weights[n]).abs().max().item() for n, p in saved.named_parameters())
        with open(os.path.join(out, "final", "config.json")) as f:
            result["distributed_config_saved"] = "distributed_config" in json.load(f)
        optimizer = torch.load(os.path.join(out, "checkpoint-2", "optimizer.pt"), weights_only=True)
        shapes = {n: tuple(w.shape) for n, w in weights.items()}
        result["optimizer_full"] = all(tuple(state["exp_avg"].shape) == shapes[n] for n, state in
                                       optimizer["state"].items()) and len(optimizer["state"]) == len(shapes)
        result["checkpoint_weights"] = len(load_file(os.path.join(out, "checkpoint-1", "model.safetensors")))
        result["files"] = sorted(os.listdir(os.path.join(out, "checkpoint-1")))
    return result


def check_lp_ft():
    from sharded_runs import EmptyCounter, vit_lp_then_ft

    trainer, weights = vit_lp_then_ft(os.path.join(OUT, "vit"), W, sharded=True)
    empty = torch.tensor([EmptyCounter.empty_micro_batches])
    dist.all_reduce(empty)
    if R == 0:
        torch.save(weights, os.path.join(OUT, "vit_lp_ft.pt"))
    return {"empty_micro_batches": int(empty), "phases": [p.name for p in trainer.engine.plan.phases],
            "steps": trainer.ledger.steps_done}


def check_lora():
    """DPTrainer(peft_config=LoRA, fsdp=True): adapters sharded with the base, saved whole, resumed exactly."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    from hf_dp_repr import DPTrainer
    from hf_dp_repr.tiny import tiny_gpt2
    from sharded_runs import _args, full_weights
    from utils import make_token_dataset

    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0, task_type="CAUSAL_LM")
    finals = []
    for name, resume in (("lora", None), ("lora_resumed", os.path.join(OUT, "lora", "checkpoint-1"))):
        args = _args(os.path.join(OUT, name), W, True, noise_multiplier=0.7, max_steps=2, save_strategy="steps",
                     save_steps=1, optim="adamw_torch")
        trainer = DPTrainer(model=tiny_gpt2(seed=0), args=args, peft_config=config,
                            train_dataset=make_token_dataset(n=48))
        trainer.train(resume_from_checkpoint=resume)
        finals.append({n: w for n, w in full_weights(trainer.model).items() if "lora" in n})
        trainer.save_model()
    result = {"resume_max_diff": max((finals[1][n] - finals[0][n]).abs().max().item() for n in finals[0]),
              "trained": len(finals[0])}
    if R == 0:
        saved = load_file(os.path.join(OUT, "lora", "adapter_model.safetensors"))
        result["adapter_shapes_full"] = sorted(tuple(v.shape) for v in saved.values()) == sorted(
            tuple(v.shape) for v in finals[0].values())
    return result


def check_loaded_sharded():
    """A model sharded at load time (from_pretrained(distributed_config=...)), no fsdp argument: trained as loaded."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_dp_repr import DPTrainer
    from sharded_runs import _args
    from utils import make_token_dataset

    path = os.path.join(OUT, "llama_files")
    if R == 0:
        tiny_llama(seed=0).save_pretrained(path)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=W))
    args = _args(os.path.join(OUT, "llama"), W, False, noise_multiplier=0.7, max_steps=1)
    trainer = DPTrainer(model=model, args=args, train_dataset=make_token_dataset(n=48))
    trainer.train()
    return {"all_dtensor": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
            "reduction": trainer.engine.options.reduction, "steps": trainer.ledger.steps_done}


def check_average(trainer, resumed, iterates: list[dict], out: str) -> dict:
    """ema_decay sharded, on check_trainer's runs (σ > 0): the average is sharded as the parameters; what is saved
    (the final model, checkpoint-1's model file) is the average of the whole iterates computed by hand, checkpoint-1
    holds the raw iterate whole, and the resumed run ends with the straight run's raw iterate."""
    from safetensors.torch import load_file

    from hf_dp_repr.scope.shards import whole
    from hf_dp_repr.training.averaging import AVERAGE_FILE, decay_at

    raws = [{n: whole(t) for n, t in run.weight_average.raw.items()} for run in (trainer, resumed)]
    result = {"all_dtensor": all(isinstance(t, DTensor) for t in trainer.weight_average.average.values()),
              "resume_raw_diff": max((raws[1][n] - raws[0][n]).abs().max().item() for n in raws[0])}
    if R != 0:
        return result
    seen = [{n: w.double() for n, w in step.items()} for step in iterates]
    hand = [seen[0]]
    for t, theta in enumerate(seen[1:]):
        d = decay_at(EMA_DECAY, t)
        hand.append({n: d * hand[-1][n] + (1 - d) * theta[n] for n in theta})

    def off(saved, want):  # the largest difference over the tensors of `want` that `saved` holds, relative
        return max((saved[n].double() - want[n]).abs().max().item() for n in want if n in saved) / max(
            w.abs().max().item() for w in want.values())

    checkpoint = os.path.join(out, "checkpoint-1")
    raw = torch.load(os.path.join(checkpoint, AVERAGE_FILE), weights_only=True)["raw"]
    result.update(steps=len(seen) - 1, saved_vs_hand=off(load_file(os.path.join(out, "final", "model.safetensors")),
                                                          hand[2]),
                  checkpoint_vs_hand=off(load_file(os.path.join(checkpoint, "model.safetensors")), hand[1]),
                  checkpoint_raw_vs_iterate=off(raw, seen[1]), raw_vs_last_iterate=off(raws[0], seen[2]),
                  average_vs_last_iterate=off(hand[2], seen[2]))
    return result


# ---- 5. augmentation_multiplicity and probe_preconditioning (issue 31) ------------------------------------------
def check_accuracy_arguments():
    """σ = 0: the final weights of the views run and of the preconditioned probe (with ema_decay), which
    tests/test_sharding.py compares with the same runs in one unsharded process."""
    from sharded_runs import full_weights, probe_run, views_run

    views = views_run(os.path.join(OUT, "views"), W)
    probe = probe_run(os.path.join(OUT, "probe"), W)
    probe_weights = full_weights(probe.model)
    if R == 0:
        torch.save({"views": views, "probe": probe_weights}, os.path.join(OUT, "accuracy.pt"))
    return {"probe_head_sharded": isinstance(probe.model.classifier.weight, DTensor)}


CHECKS = {
    "trainer": check_trainer, "lp_ft": check_lp_ft, "lora": check_lora, "loaded_sharded": check_loaded_sharded,
    "exact": lambda: {kind: check_exact(kind) for kind in ("gpt2", "llama", "vit", "gpt2_lora", "vit_lp")},
    "modes": lambda: {mode: check_exact("gpt2", mode) for mode in ("per_layer", "automatic")},
    "float64": lambda: {kind: check_exact_float64(kind) for kind in ("gpt2", "llama", "vit")},
    "noise": check_noise, "one_example": check_one_example, "one_unit": check_one_unit,
    "accuracy": check_accuracy_arguments, "adaptive": check_adaptive,
}


def main():
    """Every check, or those named after OUT_DIR (to rerun one by hand)."""
    seconds = RESULTS["seconds"] = {}  # each check's wall time on rank 0 (what a check adds to the launch)
    for name, check in CHECKS.items():
        if name in (sys.argv[2:] or CHECKS):
            start = time.perf_counter()
            RESULTS[name] = check()
            seconds[name] = round(time.perf_counter() - start, 2)
    if R == 0:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "results.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
