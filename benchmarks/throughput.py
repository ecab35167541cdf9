"""Training throughput and peak memory: non-private Trainer, DPTrainer on each clipping engine, plain Opacus.

All runs train the same model (same random init) on the same fixed-size batches in one process, one after the
other: the non-private `transformers.Trainer`, `DPTrainer` with `clipping_engine="ghost"` and `"hooks"`, and
Opacus as a user would write it (`PrivacyEngine.make_private`, per-sample gradient hooks, a plain loop).
Each run takes `--warmup` steps (not measured), then `--steps` measured steps, and the set of runs is repeated
`--rounds` times, interleaved; the table gives the median samples/s over all measured steps, the peak memory
and each run's ratio to the non-private Trainer, with the range of that ratio over the rounds (each round's median
step against the same round's non-private one): on a shared machine a single ratio can be off by 15 %.

Peak memory: on CUDA, `torch.cuda.max_memory_allocated` above the memory held before the run. On CPU (torch has no
allocator statistics there), each run is repeated alone in a fresh process (one warm-up and one step) with
`MALLOC_MMAP_THRESHOLD_=65536`, so that freed tensors go back to the OS and the resident set size (RSS, sampled
every millisecond from /proc) counts only what the run holds: the peak RSS above the RSS before the model is built.
The speed runs keep the default allocator, as users run: forcing every tensor through mmap makes each allocation
fault its pages in again, which slowed the non-private run by up to a third here and would distort the ratios.

DPTrainer runs use fixed-size shuffled batches (`poisson_sampling=False`, as the non-private run) so that every
run processes the same batch sizes; σ = 1 is given (no accounting cost in the step).

    python benchmarks/throughput.py                       # ViT (192 × 12, 32 px, patch 4, batch 64) and GPT-2
                                                          # (6 × 256, vocab 8192, seq 128, batch 16)
    python benchmarks/throughput.py --models gpt2 --steps 10
    python benchmarks/throughput.py --model path/or/hub-name --batch-size 8 --seq-len 256
    python benchmarks/throughput.py --device cuda --models gpt2-124m vit-b
    python benchmarks/throughput.py --quick               # tiny models, a smoke test
    python benchmarks/throughput.py --quick --no-memory   # speed only: no peak-memory process per run on CPU
    python benchmarks/throughput.py --parts               # also: where a step's time goes (see `parts`)

`--parts` times one micro-batch by parts, in one process, interleaved, median over `--steps` (optimizer step and data
excluded): the non-private forward+backward, against the ghost engine's forward+backward (no parameter gradient),
its per-example norms and its clipped sums. It shows what the DP step adds and where.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

MODELS = {  # name: (kind, config, batch size, sequence length)
    "vit": ("vision", dict(image_size=32, patch_size=4, num_channels=3, hidden_size=192, num_hidden_layers=12,
                           num_attention_heads=3, intermediate_size=768), 64, None),
    "gpt2": ("causal", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=128), 16, 128),
    "vit-b": ("vision", dict(image_size=224, patch_size=16, num_channels=3, hidden_size=768, num_hidden_layers=12,
                             num_attention_heads=12, intermediate_size=3072), 32, None),
    "gpt2-124m": ("causal", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024), 32, 256),
    "tiny-vit": ("vision", dict(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64), 8, None),
    "tiny-gpt2": ("causal", dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16), 4, 16),
}
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0)


def build(name: str):
    """(model factory, dataset, batch size) for a preset or any `NAME_OR_PATH` (random init from its config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification, GPT2Config, ViTConfig

    if name in MODELS:
        kind, cfg, batch, seq = MODELS[name]
        config = (ViTConfig(num_labels=10, **cfg) if kind == "vision" else GPT2Config(**cfg))
    else:
        config = AutoConfig.from_pretrained(name)
        kind = "vision" if hasattr(config, "image_size") else "causal"
        batch, seq = ARGS.batch_size or 16, ARGS.seq_len or 128
        if kind == "vision":
            config.num_labels = 10
    batch, seq = ARGS.batch_size or batch, ARGS.seq_len or seq
    for key, value in NO_DROPOUT.items():
        if hasattr(config, key):
            setattr(config, key, value)
    auto = AutoModelForImageClassification if kind == "vision" else AutoModelForCausalLM

    def make_model():
        torch.manual_seed(0)
        return auto.from_config(config)

    n = batch * (ARGS.warmup + ARGS.steps + 1)
    g = torch.Generator().manual_seed(0)
    from datasets import Dataset

    if kind == "vision":
        size, channels = config.image_size, config.num_channels
        data = {"pixel_values": torch.randn(n, channels, size, size, generator=g).numpy(),
                "labels": torch.randint(0, 10, (n,), generator=g).numpy()}
    else:
        ids = torch.randint(0, config.vocab_size, (n, seq), generator=g)
        data = {"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy(), "labels": ids.numpy()}
    return make_model, Dataset.from_dict(data).with_format("torch"), batch


class PeakMemory:
    """Peak memory above the level when entered: CUDA allocator stats, or RSS sampled from /proc on CPU."""

    def __init__(self, device: str):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.rss() - self.base)

    def __enter__(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()


def synchronize():
    if ARGS.device == "cuda":
        torch.cuda.synchronize()


def step_times_callback(times: list):
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            times.append(time.perf_counter() - self.start)

    return StepTimes()


def run_trainer(make_model, data, batch, engine: str | None) -> list[float]:
    """Step times of a non-private Trainer (engine None) or DPTrainer on `engine`."""
    from transformers import Trainer, TrainingArguments

    from hf_dp_repr import DPTrainer, DPTrainingArguments

    times: list[float] = []
    common = dict(per_device_train_batch_size=batch, max_steps=ARGS.warmup + ARGS.steps, learning_rate=1e-4,
                  report_to="none", save_strategy="no", disable_tqdm=True, logging_strategy="no",
                  use_cpu=ARGS.device == "cpu", dataloader_pin_memory=False)
    with tempfile.TemporaryDirectory() as out:
        model = make_model()
        if engine is None:
            trainer = Trainer(model=model, args=TrainingArguments(output_dir=out, **common), train_dataset=data)
        else:
            args = DPTrainingArguments(output_dir=out, noise_multiplier=1.0, target_delta=1 / (10 * len(data)),
                                       poisson_sampling=False, clipping_engine=engine, clipping=ARGS.clipping,
                                       **common)
            trainer = DPTrainer(model=model, args=args, train_dataset=data)
        trainer.add_callback(step_times_callback(times))
        trainer.train()
    return times[ARGS.warmup:]


def run_opacus(make_model, data, batch, _engine=None) -> list[float]:
    """Plain Opacus: PrivacyEngine.make_private with per-sample gradient hooks and a hand-written loop."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader

    from hf_dp_repr.privacy.grad_samplers import batch_position_ids
    from hf_dp_repr.privacy.loss import is_causal_lm, per_example_loss

    model = make_model().to(ARGS.device).train()
    causal = is_causal_lm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False)
    times = []
    for i, inputs in enumerate(loader):
        if i == ARGS.warmup + ARGS.steps:
            break
        synchronize()
        start = time.perf_counter()
        inputs = {k: v.to(ARGS.device) for k, v in inputs.items()}
        labels = inputs.pop("labels")
        batch_position_ids(model._module, inputs)
        loss = per_example_loss(model(**inputs).logits, labels, shift_labels=causal).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        times.append(time.perf_counter() - start)
    model._close()
    return times[ARGS.warmup:]


RUNS = {  # label: (runner, engine)
    "Trainer (non-private)": (run_trainer, None),
    "DPTrainer ghost": (run_trainer, "ghost"),
    "DPTrainer hooks": (run_trainer, "hooks"),
    "Opacus hooks (plain)": (run_opacus, None),
}


def cpu_peak(name: str, label: str) -> int:
    """Peak RSS of one run alone, in a fresh process whose allocator returns freed tensors (see the docstring)."""
    import subprocess

    argv = [sys.executable, os.path.abspath(__file__), "--memory-of", label, "--steps", "1", "--warmup", "1",
            "--clipping", ARGS.clipping]
    argv += ["--model", ARGS.model] if ARGS.model else ["--models", name]
    for flag, value in (("--batch-size", ARGS.batch_size), ("--seq-len", ARGS.seq_len)):
        argv += [flag, str(value)] if value else []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return int(out.split("PEAK_BYTES ")[1].split()[0])


def benchmark(name: str) -> list[tuple]:
    make_model, data, batch = build(name)
    params = sum(p.numel() for p in make_model().parameters())
    print(f"\n{name}: {params / 1e6:.2f}M parameters, batch {batch}, {ARGS.rounds} × {ARGS.steps} measured steps "
          f"after {ARGS.warmup} warm-up each, device {ARGS.device}, {torch.get_num_threads()} threads", flush=True)
    times = {label: [] for label in RUNS}
    per_round = {label: [] for label in RUNS}  # each round's median step time: the spread of the ratios
    peaks = {label: 0 for label in RUNS}
    cuda = ARGS.device == "cuda"  # on CPU the memory runs are separate (no sampling thread in the timed runs)
    for _ in range(ARGS.rounds):  # interleaved rounds: a load change on a shared machine hits every run alike
        for label, (runner, engine) in RUNS.items():
            memory = PeakMemory(ARGS.device) if cuda else contextlib.nullcontext()
            with memory, contextlib.redirect_stdout(io.StringIO()):  # Trainer metrics
                steps = runner(make_model, data, batch, engine)
            times[label] += steps
            per_round[label].append(statistics.median(steps))
            if cuda:
                peaks[label] = max(peaks[label], memory.peak)
    if not cuda:
        peaks = {label: cpu_peak(name, label) if ARGS.memory else math.nan for label in RUNS}
    rows = [(label, batch / statistics.median(times[label]), peaks[label] / 2**20) for label in RUNS]
    base_speed, base_memory = rows[0][1], rows[0][2]
    hooks_speed = rows[-1][1]
    base = per_round[rows[0][0]]
    spread = {label: [b / t for b, t in zip(base, per_round[label])] for label in RUNS}  # speed ratio per round
    print(f"| {'run':<22} | samples/s | × non-private | per round   | × Opacus hooks | peak MiB | × non-private |")
    print("|" + "|".join("-" * w for w in (24, 11, 15, 13, 16, 10, 15)) + "|")
    for label, speed, memory in rows:
        low, high = min(spread[label]), max(spread[label])
        print(f"| {label:<22} | {speed:9.1f} | {speed / base_speed:13.2f} | {low:4.2f} – {high:4.2f} | "
              f"{speed / hooks_speed:14.2f} | {memory:8.0f} | {memory / max(base_memory, 1e-9):13.2f} |", flush=True)
    return rows


def parts(name: str) -> None:
    """Where the ghost engine's micro-batch time goes, against the non-private forward+backward (see the docstring)."""
    from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine
    from hf_dp_repr.privacy.grad_samplers import batch_position_ids
    from hf_dp_repr.privacy.loss import is_causal_lm, per_example_loss

    make_model, data, batch = build(name)
    model = make_model().to(ARGS.device).train()
    inputs = {k: v.to(ARGS.device) for k, v in data[:batch].items()}
    labels = inputs.pop("labels")
    batch_position_ids(model, inputs)
    causal = is_causal_lm(model)

    def loss():
        return per_example_loss(model(**inputs).logits, labels, shift_labels=causal).sum()

    engine = GhostClippingEngine(model)
    times = {key: [] for key in ("non-private forward+backward", "ghost forward+backward", "ghost norms",
                                 "ghost clipped sums")}
    for step in range(ARGS.warmup + ARGS.steps):
        marks = [time.perf_counter()]
        model.zero_grad(set_to_none=True)
        loss().backward()
        synchronize()
        marks.append(time.perf_counter())
        with engine.recording():
            loss().backward()
        synchronize()
        marks.append(time.perf_counter())
        norms = engine.squared_norms()
        total = torch.stack([norms[p] for p in engine.params], 1).sum(1).sqrt()
        factor = (1.0 / (total + 1e-6)).clamp(max=1.0)
        synchronize()
        marks.append(time.perf_counter())
        engine.clipped_sums({p: factor for p in engine.params})
        synchronize()
        marks.append(time.perf_counter())
        if step >= ARGS.warmup:
            for key, start, end in zip(times, [marks[0], *marks[1:-1]], marks[1:]):
                times[key].append(end - start)
    engine.remove()
    median = {key: statistics.median(v) for key, v in times.items()}
    base = median["non-private forward+backward"]
    ghost = sum(v for key, v in median.items() if key.startswith("ghost"))
    print(f"\n{name}, one micro-batch of {batch} by parts (median of {ARGS.steps}, ms; × the non-private "
          "forward+backward):")
    for key, value in median.items():
        print(f"  {key:<30} {value * 1e3:9.1f}  {value / base:5.2f}")
    print(f"  {'ghost total':<30} {ghost * 1e3:9.1f}  {ghost / base:5.2f}   (speed ratio {base / ghost:.2f})")


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vit", "gpt2"], help=f"presets: {', '.join(MODELS)}")
    parser.add_argument("--model", help="any config name or path (random weights from its config)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the set of runs, interleaved (median of all)")
    parser.add_argument("--clipping", default="flat", choices=["flat", "per_layer", "automatic"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 warm-up + 2 steps (a smoke test)")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the peak memory (on CPU: one process per run); its columns show nan")
    parser.add_argument("--parts", action="store_true", help="also time one micro-batch by parts (see the docstring)")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: one run's peak RSS, in a child process
    ARGS = parser.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()  # the DP plan and warnings of every run would bury the table
    import logging as std_logging

    std_logging.getLogger("hf_dp_repr").setLevel(std_logging.ERROR)
    if ARGS.quick:
        ARGS.models, ARGS.steps, ARGS.warmup = ["tiny-vit", "tiny-gpt2"], 2, 1
    if ARGS.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if ARGS.memory_of:
        make_model, data, batch = build(ARGS.model or ARGS.models[0])
        runner, engine = RUNS[ARGS.memory_of]
        with PeakMemory("cpu") as memory, contextlib.redirect_stdout(io.StringIO()):
            runner(make_model, data, batch, engine)
        print("PEAK_BYTES", memory.peak)
        return
    for name in ([ARGS.model] if ARGS.model else ARGS.models):
        benchmark(name)
        if ARGS.parts:
            parts(name)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
