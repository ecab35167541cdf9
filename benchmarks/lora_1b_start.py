"""A Llama-style 0.84B model with LoRA (r = 16 on q_proj, v_proj), sequence 256, batch 2: DPTrainer's fixed cost before
the first step (the start-of-training checks) and the peak resident memory of DP-SGD against the non-private Trainer.

Each contender runs alone in a fresh process (random weights from a LlamaConfig, fp32, 3.2 GB), with
`MALLOC_MMAP_THRESHOLD_=65536` so that freed tensors go back to the OS and the RSS (sampled every millisecond from
/proc) counts what the run holds; "peak" is the largest RSS above the RSS before the model was built. "start" is the
time from `train()` to the first step's beginning (DPTrainer: the input checks, the probe, the plan, the engine);
the plan line's "probe" figure is the probe's own share.

    python benchmarks/lora_1b_start.py                      # dp then plain, 3 steps each, one process each
    python benchmarks/lora_1b_start.py --contenders dp --profile /tmp/start.prof   # cProfile of the start
    python benchmarks/lora_1b_start.py --small            # the same run at ~60M parameters, in a minute

The run needs ~10 GB of memory: run it alone (`flock /work/notes/heavy.lock ...` on the shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from realistic_sizes import LLAMA_1B, PeakRSS  # benchmarks/, the script's folder, is on sys.path

CONFIG = LLAMA_1B
SMALL = dict(CONFIG, hidden_size=512, num_hidden_layers=4, intermediate_size=1408, num_attention_heads=8,
             num_key_value_heads=2)  # --small: the same shape of run at ~60M parameters (no lock needed)


def high_water() -> int:
    """VmHWM: the process's peak RSS, imports included."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def one(contender: str, steps: int, profile: str | None, config: dict) -> dict:
    """Build, train `steps` steps, return the figures (run in a child process)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_dp_repr import DPTrainer, DPTrainingArguments

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    batch, seq = 2, 256
    n = 64
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (n, seq), generator=g)
    data = Dataset.from_dict({"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy(),
                              "labels": ids.numpy()}).with_format("torch")
    peak = PeakRSS()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0))
    built = time.perf_counter() - t0
    marks: dict = {}

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks.setdefault("first_step", time.perf_counter())
            marks.setdefault("start_peak", peak.peak)

        def on_step_end(self, args, state, control, **kwargs):
            marks.setdefault("steps", []).append(time.perf_counter())

    common = dict(per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-4, report_to="none",
                  save_strategy="no", disable_tqdm=True, logging_strategy="no", use_cpu=True,
                  dataloader_pin_memory=False)
    with tempfile.TemporaryDirectory() as out:
        if contender == "plain":
            trainer = Trainer(model=model, args=TrainingArguments(output_dir=out, **common), train_dataset=data)
        else:
            args = DPTrainingArguments(output_dir=out, noise_multiplier=1.0, target_delta=1e-5,
                                       poisson_sampling=False, **common)
            trainer = DPTrainer(model=model, args=args, train_dataset=data)
        trainer.add_callback(Marks())
        start = time.perf_counter()
        if profile:
            import cProfile

            with cProfile.Profile() as prof:
                trainer.train()
            prof.dump_stats(profile)
        else:
            trainer.train()
    peak_bytes = peak.stop()
    step_times = [b - a for a, b in zip([marks["first_step"], *marks["steps"]], marks["steps"])]
    return {"contender": contender, "build_s": round(built, 1), "start_s": round(marks["first_step"] - start, 2),
            "step_s": [round(s, 2) for s in step_times], "peak_mb": round(peak_bytes / 2**20),
            "start_peak_mb": round(marks["start_peak"] / 2**20), "base_mb": round(peak.base / 2**20),
            "hwm_mb": round(high_water() / 2**20), "malloc": os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"),
            "probe_s": None if contender == "plain" else trainer.start_checks.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", nargs="+", default=["dp", "plain"], choices=["dp", "plain"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", help="cProfile the DP run's train() into this file")
    parser.add_argument("--default-malloc", action="store_true",
                        help="glibc's default allocator (as users run): freed memory may stay in the process")
    parser.add_argument("--small", action="store_true", help="a ~60M-parameter model of the same shape (a smoke test)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.steps, args.profile, SMALL if args.small else CONFIG)), flush=True)
        return
    for contender in args.contenders:
        env = dict(os.environ) if args.default_malloc else {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        cmd = [sys.executable, __file__, "--child", contender, "--steps", str(args.steps)]
        if args.profile:
            cmd += ["--profile", args.profile]
        if args.small:
            cmd.append("--small")
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
