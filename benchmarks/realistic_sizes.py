"""DP against non-private training at the sizes users train, side by side: step rate, peak memory, start-up cost.

Configurations (random weights from their configs, the default DPTrainer: ghost engine, flat clipping, σ = 1,
fixed-size shuffled batches, AdamW; the non-private contender is `transformers.Trainer` on the same model):

    gpt2-124m        GPT-2 124M (GPT2Config()), full fine-tuning, sequence 256, batch 4
    gpt2-124m-lora   the same, LoRA r = 8 on c_attn
    vit-b            ViT-B/16 (ViTConfig()), 224 px, batch 8, full fine-tuning
    llama-1b-lora    Llama-style (hidden 2048, 16 layers, `benchmarks/lora_1b_start.py`'s config), LoRA r = 16 on
                     q_proj, v_proj, sequence 256, batch 2
    smollm2-lora     SmolLM2-135M-Instruct's architecture (Llama, 30 layers, hidden 576, tied embeddings; issue
                     44's model, random weights), LoRA r = 8 on q_proj, v_proj, sequence 64, batch 16: the SFT
                     step of `benchmarks/smollm2.py`
    vit, gpt2        `benchmarks/throughput.py`'s small configs (ViT 5.4M, batch 64; GPT-2 6.9M, batch 16)
    tiny-gpt2-lora   a smoke test (`tests/test_throughput_bench.py`)

Every run is a fresh process (so a run never inherits another's allocator state or caches). Speed: `--rounds`
interleaved rounds, each running non-private then DP (the order alternates between rounds), each `--warmup` steps
then `--steps` measured steps on the same fixed batches; the ratio is DP/non-private steps per second from the
median step of each contender, and "per round" the range of that ratio over the rounds. Start-up: the time from
`train()` to the first step's beginning (DPTrainer: the input checks, the start-of-training probe, the plan and the
engine), median over the rounds; the DP figure minus the non-private one is the fixed cost DP adds to every run.
Memory: each contender once more alone, one warm-up and one step, with `MALLOC_MMAP_THRESHOLD_=65536` so freed
tensors leave the resident set (RSS, sampled every millisecond from /proc): the peak RSS above the RSS before the
model is built (not used for speed: that allocator slows every run, see `throughput.py`). `--limit`: the arithmetic
DP adds to the step (the per-example norms' Gram matrices and dot products, the noise draws) timed alone in one more
process; the non-private step plus it is the best this engine can do (`limit`).

    python benchmarks/realistic_sizes.py --small              # the small configs, a few minutes on 2 cores
    python benchmarks/realistic_sizes.py --configs gpt2-124m --rounds 3 --limit   # and the best ratio possible
    python benchmarks/realistic_sizes.py --configs llama-1b-lora --rounds 2 --steps 2   # ~10 GB: run it alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=512, tie_word_embeddings=True,
                    rope_theta=100000.0, rms_norm_eps=1e-5)
CONFIGS = {  # name: (family, config kwargs, batch, sequence length, LoRA (r, target modules) or None)
    "gpt2-124m": ("gpt2", {}, 4, 256, None),
    "gpt2-124m-lora": ("gpt2", {}, 4, 256, (8, ["c_attn"])),
    "vit-b": ("vit", dict(num_labels=10), 8, None, None),
    "llama-1b-lora": ("llama", LLAMA_1B, 2, 256, (16, ["q_proj", "v_proj"])),
    "smollm2-lora": ("llama", SMOLLM2_135M, 16, 64, (8, ["q_proj", "v_proj"])),
    "vit": ("vit", dict(image_size=32, patch_size=4, hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                        intermediate_size=768, num_labels=10), 64, None, None),
    "gpt2": ("gpt2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=128), 16, 128, None),
    "tiny-gpt2-lora": ("gpt2", dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16), 4, 16,
                       (4, ["c_attn"])),  # a smoke test's
}
SMALL = ["vit", "gpt2"]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Largest RSS above the level at creation, sampled every millisecond."""

    def __init__(self):
        self.base, self.peak, self._stop = rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss() - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def build(name: str):
    """(model, dataset, batch) of a configuration: random weights (seed 0), LoRA applied to the model."""
    import torch
    from datasets import Dataset
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        ViTConfig,
        ViTForImageClassification,
    )

    family, kwargs, batch, seq, lora = CONFIGS[name]
    config_class, model_class = {"gpt2": (GPT2Config, GPT2LMHeadModel), "llama": (LlamaConfig, LlamaForCausalLM),
                                 "vit": (ViTConfig, ViTForImageClassification)}[family]
    config = config_class(**kwargs)
    torch.manual_seed(0)
    model = model_class(config)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        r, targets = lora
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0))
    n = batch * (ARGS.warmup + ARGS.steps + 1)
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        size = config.image_size
        data = {"pixel_values": torch.randn(n, 3, size, size, generator=g).numpy(),
                "labels": torch.randint(0, 10, (n,), generator=g).numpy()}
    else:
        ids = torch.randint(0, config.vocab_size, (n, seq), generator=g)
        data = {"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy(), "labels": ids.numpy()}
    return model, Dataset.from_dict(data).with_format("torch"), batch


def child(name: str, contender: str) -> dict:
    """One contender's run in this process: start-up time, step times, peak RSS above the start."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_dp_repr import DPTrainer, DPTrainingArguments

    peak = PeakRSS() if ARGS.memory else None
    model, data, batch = build(name)
    marks: dict = {"steps": []}

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks["begin"] = time.perf_counter()
            marks.setdefault("first", marks["begin"])

        def on_step_end(self, args, state, control, **kwargs):
            marks["steps"].append(time.perf_counter() - marks["begin"])

    common = dict(per_device_train_batch_size=batch, max_steps=ARGS.warmup + ARGS.steps, learning_rate=1e-4,
                  report_to="none", save_strategy="no", disable_tqdm=True, logging_strategy="no", use_cpu=True,
                  dataloader_pin_memory=False)
    with tempfile.TemporaryDirectory() as out:
        if contender == "non-private":
            trainer = Trainer(model=model, args=TrainingArguments(output_dir=out, **common), train_dataset=data)
        else:
            args = DPTrainingArguments(output_dir=out, noise_multiplier=1.0, target_delta=1 / (10 * len(data)),
                                       poisson_sampling=False, **common)
            trainer = DPTrainer(model=model, args=args, train_dataset=data)
        trainer.add_callback(Marks())
        start = time.perf_counter()
        trainer.train()
    return {"start_s": marks["first"] - start, "steps_s": marks["steps"][ARGS.warmup:],
            "peak_bytes": peak.stop() if peak else None}


def limit(name: str) -> dict:
    """The arithmetic DP must add to the non-private step, timed alone (median of `--steps`): the ghost engine's
    per-example norms (the Gram matrices of every trained layer at its shape, and their dot products) on one real
    batch's inputs and output gradients, and the Gaussian noise of every trained tensor (one draw per tensor, as the
    step draws it). The non-private step plus these is the fastest a DP step of this engine can be."""
    import torch

    from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine
    from hf_dp_repr.privacy.grad_samplers import batch_position_ids
    from hf_dp_repr.privacy.loss import is_causal_lm, per_example_loss

    model, data, batch = build(name)
    model.train()
    inputs = dict(data[:batch])
    labels = inputs.pop("labels")
    batch_position_ids(model, inputs)
    engine = GhostClippingEngine(model)
    with engine.recording(batch):
        per_example_loss(model(**inputs).logits, labels, shift_labels=is_causal_lm(model)).sum().backward()
    sizes = [p.numel() for p in engine.params]
    buffer, generator = torch.empty(max(sizes)), torch.Generator().manual_seed(0)

    def noise():
        for n in sizes:
            buffer[:n].normal_(0.0, 1.0, generator=generator)

    times = {"norms_s": [], "noise_s": []}
    for _ in range(ARGS.warmup + ARGS.steps):
        for key, work in (("norms_s", engine.squared_norms), ("noise_s", noise)):
            start = time.perf_counter()
            work()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t[ARGS.warmup:]) for key, t in times.items()}


def run_child(name: str, contender: str, memory: bool) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", name, contender, "--steps", str(ARGS.steps),
            "--warmup", str(ARGS.warmup)] + (["--memory"] if memory else [])
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "65536"} if memory else {})}
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{name} {contender} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def benchmark(name: str) -> None:
    contenders = ["non-private", "dp"]
    steps = {c: [] for c in contenders}
    round_median = {c: [] for c in contenders}
    starts = {c: [] for c in contenders}
    for r in range(ARGS.rounds):
        for contender in (contenders if r % 2 == 0 else contenders[::-1]):
            result = run_child(name, contender, memory=False)
            steps[contender] += result["steps_s"]
            round_median[contender].append(statistics.median(result["steps_s"]))
            starts[contender].append(result["start_s"])
    peaks = {c: run_child(name, c, memory=True)["peak_bytes"] / 2**20 if ARGS.memory_runs else float("nan")
             for c in contenders}
    ratio = statistics.median(steps["non-private"]) / statistics.median(steps["dp"])
    if ARGS.limit:
        extra = run_child(name, "limit", memory=False)
        plain = statistics.median(steps["non-private"])
        print(f"{name}: per-example norms {extra['norms_s']:.3f} s, noise {extra['noise_s']:.3f} s a step: the limit "
              f"is {plain / (plain + extra['norms_s'] + extra['noise_s']):.2f}× non-private", flush=True)
    per_round = [a / b for a, b in zip(round_median["non-private"], round_median["dp"])]
    start = {c: statistics.median(starts[c]) for c in contenders}
    print(f"| {name} | {statistics.median(steps['non-private']):.3f} | {statistics.median(steps['dp']):.3f} | "
          f"{ratio:.2f} | {min(per_round):.2f} – {max(per_round):.2f} | {peaks['non-private']:.0f} | "
          f"{peaks['dp']:.0f} | {peaks['dp'] / peaks['non-private']:.2f} | {start['non-private']:.1f} | "
          f"{start['dp']:.1f} | {start['dp'] - start['non-private']:.1f} |", flush=True)


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if not c.startswith("tiny")],
                        choices=list(CONFIGS))
    parser.add_argument("--small", action="store_true", help=f"the small configs only ({', '.join(SMALL)})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-memory", dest="memory_runs", action="store_false", help="skip the peak-RSS runs")
    parser.add_argument("--limit", action="store_true",
                        help="also time what DP adds (norms, noise) alone: the best ratio this engine can reach")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # internal: one run, in a fresh process
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    ARGS = parser.parse_args()
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("hf_dp_repr").setLevel(logging.ERROR)
    if ARGS.child:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's metrics
            result = limit(ARGS.child[0]) if ARGS.child[1] == "limit" else child(*ARGS.child)
        print(json.dumps(result), flush=True)
        return
    names = SMALL if ARGS.small else ARGS.configs
    print(f"{ARGS.rounds} rounds × {ARGS.steps} steps after {ARGS.warmup} warm-up, step times in s, peak RSS in MiB, "
          "start-up (train() to the first step) in s", flush=True)
    print("| config | non-private step | DP step | DP/non-private speed | per round | non-private peak | DP peak "
          "| × | non-private start | DP start | DP adds |")
    print("|" + "---|" * 11, flush=True)
    for name in names:
        benchmark(name)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
