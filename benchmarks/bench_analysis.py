"""Cost of the representation analyzers (not a test): time against plain forward passes, memory against tokens.

1. Time. `analyze_representations` over N images (all hidden states: D_l and PR_l streamed per batch) against
   the same model's plain forward passes over the same batches, measured side by side and interleaved in one
   run (`--repeats` rounds; the ratio of medians is printed). Target: ≤ 1.5×.
2. Memory. The causal-LM analysis over T and 4T tokens, each in a fresh process; prints each run's peak RSS.
   The per-layer statistics are O(layers · d²), so the peak should not grow with the number of tokens (an
   in-memory collection of every layer's features is printed for scale).

    python benchmarks/bench_analysis.py                       # ViT-S-like (12 × 384) on 32×32, 2000 images
    python benchmarks/bench_analysis.py --vision tiny --examples 2000 --repeats 5

Timings on a machine shared with other jobs swing widely (OpenMP threads stall when cores are busy); the
interleaved rounds and medians damp that, `--threads 1` avoids most of it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time

import torch

VISION_CONFIGS = {
    # ViT-S/8 width and depth on 32×32 RGB (17 tokens): a realistic d for the d² statistics.
    "vit-s": dict(image_size=32, patch_size=8, num_channels=3, hidden_size=384, num_hidden_layers=12,
                  num_attention_heads=6, intermediate_size=1536),
    "tiny": dict(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=4, intermediate_size=128),
}


def vision_data(cfg: dict, n: int, num_labels: int = 10):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(n, cfg["num_channels"], cfg["image_size"], cfg["image_size"], generator=g)
    labels = torch.randint(0, num_labels, (n,), generator=g)
    return Dataset.from_dict({"pixel_values": pixels.numpy(), "labels": labels.numpy()}).with_format("torch")


def time_vision(args) -> None:
    from transformers import ViTConfig, ViTForImageClassification

    from hf_dp_repr.analysis import analyze_representations

    cfg = VISION_CONFIGS[args.vision]
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(num_labels=10, **cfg)).eval()
    data = vision_data(cfg, args.examples)
    params = sum(p.numel() for p in model.parameters()) / 1e6

    def forward_only():
        with torch.no_grad():
            for batch in data.iter(batch_size=args.batch_size):
                model(pixel_values=batch["pixel_values"])

    def analysis():
        analyze_representations(model, data, batch_size=args.batch_size, progress=False)

    forward_only(), analysis()  # warm-up: allocator, first-call overheads
    fwd, ana = [], []
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both alike
        t = time.perf_counter(); forward_only(); fwd.append(time.perf_counter() - t)  # noqa: E702
        t = time.perf_counter(); analysis(); ana.append(time.perf_counter() - t)  # noqa: E702
    f, a = statistics.median(fwd), statistics.median(ana)
    layers = cfg["num_hidden_layers"] + 1
    print(f"[time] {args.vision}: {params:.1f}M params, d={cfg['hidden_size']}, {layers} hidden states, "
          f"{args.examples} images, batch {args.batch_size}, {torch.get_num_threads()} threads")
    print(f"[time] forward passes alone : median {f:7.2f} s   (runs: {', '.join(f'{x:.2f}' for x in fwd)})")
    print(f"[time] full analysis        : median {a:7.2f} s   (runs: {', '.join(f'{x:.2f}' for x in ana)})")
    print(f"[time] ratio analysis/forward = {a / f:.3f}   (target ≤ 1.5)")


def _language_child(tokens: int, seq_len: int, batch_size: int, analyse: bool, queue) -> None:
    from datasets import Dataset

    from hf_dp_repr.analysis import analyze_representations
    from hf_dp_repr.tiny import tiny_gpt2

    torch.set_num_threads(1)
    model = tiny_gpt2(n_embd=256, n_layer=6, n_head=8, n_positions=seq_len, vocab_size=1024).eval()
    n_seq = tokens // seq_len
    ids = torch.randint(0, 1024, (n_seq, seq_len), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.numpy()}).with_format("torch")
    t = time.perf_counter()
    if analyse:
        positions = analyze_representations(model, data, batch_size=batch_size, progress=False).num_positions
    else:  # the same forward passes, hidden states requested and dropped: the baseline peak
        with torch.no_grad():
            for batch in data.iter(batch_size=batch_size):
                model(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]),
                      output_hidden_states=True)
        positions = n_seq * (seq_len - 1)
    elapsed = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    queue.put((positions, peak / 1024, elapsed, model.config.n_layer + 1))


def memory_language(args) -> None:
    ctx = mp.get_context("spawn")  # a fresh process per run: ru_maxrss is a high-water mark
    d = 256
    print("[memory] GPT-2-like LM, 6 blocks, d=256, sequences of 128, batch 16; each run in a fresh process")
    for tokens in (args.tokens, 4 * args.tokens):
        peaks = {}
        for analyse in (False, True):
            queue = ctx.Queue()
            proc = ctx.Process(target=_language_child, args=(tokens, 128, 16, analyse, queue))
            proc.start()
            positions, peaks[analyse], elapsed, layers = queue.get()
            proc.join()
        in_memory = positions * layers * d * 4 / 2**20  # float32 features of every layer, for scale
        print(f"[memory] {positions:>9,} predicted tokens: peak RSS analysis {peaks[True]:7.1f} MiB, "
              f"forward passes alone {peaks[False]:7.1f} MiB; keeping all features would add {in_memory:6.1f} MiB")
    stats = layers * (d + 1) ** 2 * 8 / 2**20
    print(f"[memory] per-layer statistics: {layers} × (d+1)² float64 = {stats:.1f} MiB, independent of tokens")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vision", choices=sorted(VISION_CONFIGS), default="vit-s")
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32_000, help="smaller token count of the memory test (×4 too)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); 1 is steadier on a busy shared machine")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_time:
        time_vision(args)
    if not args.skip_memory:
        memory_language(args)


if __name__ == "__main__":
    main()
