"""Cost of a DP linear probe per epoch, with and without cached head inputs (not a test).

Both runs are the same DP-SGD linear probe (trainable_blocks=0, same Poisson batches, clipping and noise);
one runs the frozen backbone at every step, the other computes the head inputs once
(`cache_features=True`). Measured side by side in one run; the ratio is printed.

    python benchmarks/bench_linear_probe.py                   # ViT-S-like (12 × 384) on 32×32, 2000 images, 2 epochs
    python benchmarks/bench_linear_probe.py --vision tiny --examples 1437
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from bench_analysis import VISION_CONFIGS, vision_data
from transformers import ViTConfig, ViTForImageClassification

from hf_dp_repr import DPTrainer, DPTrainingArguments


def run(cfg: dict, data, epochs: int, batch: int, cache: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(num_labels=10, **cfg))
    with tempfile.TemporaryDirectory() as out:
        args = DPTrainingArguments(output_dir=out, trainable_blocks=0, cache_features=cache, target_epsilon=8.0,
                                   target_delta=1e-5, per_device_train_batch_size=batch, num_train_epochs=epochs,
                                   learning_rate=0.05, report_to="none", save_strategy="no", disable_tqdm=True)
        trainer = DPTrainer(model=model, args=args, train_dataset=data)
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start
        return total, trainer.state.log_history[-1]["train_runtime"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vision", choices=sorted(VISION_CONFIGS), default="vit-s")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    cfg = VISION_CONFIGS[args.vision]
    data = vision_data(cfg, args.examples)
    plain_total, plain_loop = run(cfg, data, args.epochs, args.batch_size, cache=False)
    cached_total, cached_loop = run(cfg, data, args.epochs, args.batch_size, cache=True)
    print(f"{args.vision}: {args.examples} images, {args.epochs} epochs, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads")
    print(f"uncached : {plain_loop / args.epochs:8.3f} s per epoch   (train() total {plain_total:.2f} s)")
    print(f"cached   : {cached_loop / args.epochs:8.3f} s per epoch   (train() total {cached_total:.2f} s, including "
          f"the one-time feature pass {cached_total - cached_loop:.2f} s)")
    print(f"per-epoch speed-up = {plain_loop / cached_loop:.1f}×; whole run = {plain_total / cached_total:.1f}×")


if __name__ == "__main__":
    main()
