"""Peak memory per rank of DP-SGD training, DDP (a whole model per process) against FSDP2 (DPTrainer's `fsdp=True`),
2 processes, GPT-2 124M shapes (random init), the real DPTrainer path: ghost clipping, σ = 1, AdamW, Poisson batches
of 4 sequences × 128 tokens expected per rank, 3 steps. Plus the paper estimate for W ranks.

On CPU (gloo): resident set size per rank, with `MALLOC_MMAP_THRESHOLD_=65536` so that freed big tensors go back to
the OS (otherwise glibc keeps them and every number reads the same); VmHWM is reset (/proc/self/clear_refs) once the
trainer is built, so "peak" is the high-water mark during the steps and "steady" the RSS after them. With CUDA
(nccl): `torch.cuda.max_memory_allocated` during the steps and `memory_allocated` after them.

    python benchmarks/sharded_memory.py                    # both modes, 2 processes each, then the table
    python benchmarks/sharded_memory.py --modes fsdp2 --nproc 4 --steps 2

Each rank loads the whole model before DPTrainer shards it, so the load itself peaks at the full size per rank (not
measured here: VmHWM is reset after); a model that does not fit is loaded sharded with
`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W))`.

Paper estimate (bytes per parameter: fp32 weights 4 + clipped-sum accumulator 4 + gradient 4 + Adam 8 = 20; A =
activations and ghost factors, which sharding does not change):
    DDP   ≈ 20·P + A
    FSDP2 ≈ 20·P/W + 4·(P_root + 2·P_block) + 4·P_maxtensor + A
(the root group, which holds the tied embeddings, is gathered through the whole forward and backward; the current and
the prefetched block; one tensor's full clipped sum before its reduce-scatter).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

MODES = ("ddp", "fsdp2")


def _status(field: str) -> float:
    """A /proc/self/status field in MiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(mode: str, steps: int, batch: int, seq: int, out: str) -> None:
    """One rank of one mode (run by torch.distributed.run): build, train, report its memory as JSON lines."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback
    from transformers.utils import logging as hf_logging

    from hf_dp_repr import DPTrainer, DPTrainingArguments

    hf_logging.set_verbosity_error()
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=seq))
    world = int(os.environ["WORLD_SIZE"])
    rng = np.random.default_rng(0)
    n = 16 * batch * world
    ids = rng.integers(1, model.config.vocab_size, size=(n, seq))
    data = Dataset.from_dict({"input_ids": ids, "labels": ids}).with_format("torch")
    sharding = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if mode == "fsdp2" else {}
    args = DPTrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=steps,
                               noise_multiplier=1.0, target_delta=1e-5, per_sample_max_grad_norm=1.0,
                               clipping_engine="ghost", optim="adamw_torch", learning_rate=1e-4, report_to="none",
                               save_strategy="no", disable_tqdm=True, noise_seed=0, **sharding)
    found = {}

    class Memory(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            found["after_setup"] = _status("VmRSS")
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            else:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM := VmRSS

        def on_train_end(self, *a, **kw):
            if cuda:
                found.update(peak=torch.cuda.max_memory_allocated() / 2**20,
                             steady=torch.cuda.memory_allocated() / 2**20)
            else:
                found.update(peak=_status("VmHWM"), steady=_status("VmRSS"))

    trainer = DPTrainer(model=model, args=args, train_dataset=data, callbacks=[Memory()])
    trainer.train()
    found.update(rank=dist.get_rank(), mode=mode, world=world, params=sum(p.numel() for p in model.parameters()),
                 sharded=trainer.sharded, wrapped=type(trainer.model_wrapped).__name__)
    with open(out, "a") as f:
        f.write(json.dumps(found) + "\n")


def estimate(world: int) -> dict[str, float]:
    """The paper estimate for GPT-2 124M (tied wte/lm_head) in GB, without activations."""
    from transformers import GPT2Config

    c = GPT2Config()
    wte, wpe, d = c.vocab_size * c.n_embd, c.n_positions * c.n_embd, c.n_embd
    block = 12 * d * d + 13 * d  # attention (4 d² + 4 d), MLP (8 d² + 5 d), 2 LayerNorms (4 d)
    root = wte + wpe + 2 * d
    total = root + c.n_layer * block
    return {"P": total, "ddp": 20 * total / 1e9,
            "fsdp2": (20 * total / world + 4 * (root + 2 * block) + 4 * wte) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="expected sequences per rank and step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        return worker(a.worker, a.steps, a.batch, a.seq, a.out)
    import torch

    out = tempfile.mktemp(suffix=".jsonl")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_USE_")}
    for mode in a.modes:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(a.nproc), __file__, "--worker", mode, "--out", out, "--steps", str(a.steps), "--batch",
                        str(a.batch), "--seq", str(a.seq)], env=env, check=True)
    with open(out) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: (r["mode"], r["rank"]))
    unit = "MiB allocated (CUDA)" if torch.cuda.is_available() else "MiB RSS (CPU)"
    cpu = platform.processor() or platform.machine()
    print(f"\nGPT-2 124M shapes ({rows[0]['params'] / 1e6:.1f}M parameters), {a.nproc} processes, {a.steps} steps of "
          f"{a.batch} × {a.seq} tokens per rank; torch {torch.__version__}, {cpu}, nproc {os.cpu_count()}, load "
          f"{os.getloadavg()[0]:.2f} (1 min) after the runs")
    print(f"| mode | rank | wrapped by | after setup | steady after steps | peak during steps |  ({unit})")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['rank']} | {r['wrapped']} | {r['after_setup']:.0f} | {r['steady']:.0f} | "
              f"{r['peak']:.0f} |")
    peaks = {m: max(r["peak"] for r in rows if r["mode"] == m) for m in a.modes}
    if len(peaks) == 2:
        print(f"peak FSDP2 / DDP: {peaks['fsdp2'] / peaks['ddp']:.2f}")
    for world in sorted({a.nproc, 8}):
        e = estimate(world)
        print(f"paper estimate, W = {world}: DDP {e['ddp']:.2f} GB, FSDP2 {e['fsdp2']:.2f} GB per rank "
              f"(P = {e['P'] / 1e6:.2f}M; + activations)")


if __name__ == "__main__":
    main()
