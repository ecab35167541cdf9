"""Per-epoch cost of DP fine-tuning the last k blocks with and without the prefix cache (`cache_features`).

A ViT-S-sized model (hidden 384, 6 heads, 12 blocks, MLP 1536; random weights), small random images, a few hundred
examples. For k = 1 and 2, one epoch of DPTrainer each way, side by side in one process:
- uncached: the 12-k frozen blocks run at every step (cache_features=False);
- cached, first epoch: the feature pass over the training set + the epoch;
- cached, later epoch: the states are already in this process (a new trainer, as a sweep's next trial).
The load average is printed beside the numbers: the machine is shared.

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/prefix_cache.py [--examples 128 --image_size 64 --batch 32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from datasets import Dataset
from transformers import ViTConfig, ViTForImageClassification

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.scope.feature_store import clear_feature_cache


def vit_s(image_size: int, patch_size: int) -> ViTForImageClassification:
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(
        image_size=image_size, patch_size=patch_size, num_channels=3, hidden_size=384, num_hidden_layers=12,
        num_attention_heads=6, intermediate_size=1536, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=10))


def random_images(n: int, image_size: int) -> Dataset:
    rng = np.random.default_rng(0)
    return Dataset.from_dict({"pixel_values": rng.standard_normal((n, 3, image_size, image_size), dtype=np.float32),
                              "labels": rng.integers(0, 10, n)}).with_format("torch")


def one_epoch(data: Dataset, k: int, cache: bool, opts) -> float:
    """Seconds of one DP epoch training the last k blocks (train() wall clock, feature pass included)."""
    with tempfile.TemporaryDirectory() as out:
        args = DPTrainingArguments(output_dir=out, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                                   trainable_blocks=k, cache_features=cache, per_device_train_batch_size=opts.batch,
                                   per_device_eval_batch_size=opts.batch, num_train_epochs=1, learning_rate=1e-3,
                                   report_to="none", save_strategy="no", disable_tqdm=True, logging_strategy="no",
                                   noise_seed=0)
        trainer = DPTrainer(model=vit_s(opts.image_size, opts.patch_size), args=args, train_dataset=data)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        assert (trainer.features.prefix_states is not None) == cache
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=128)
    parser.add_argument("--image_size", type=int, default=64, help="64 px, patch 4: 257 tokens, as DINOv2-S at 224 px")
    parser.add_argument("--patch_size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    opts = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    logging.getLogger("hf_dp_repr").setLevel(logging.ERROR)
    data = random_images(opts.examples, opts.image_size)
    tokens = (opts.image_size // opts.patch_size) ** 2 + 1
    print(f"ViT-S-sized (384 wide, 12 blocks, {tokens} tokens), {opts.examples} examples, expected batch "
          f"{opts.batch}, torch threads {torch.get_num_threads()}; load average before: {os.getloadavg()}")
    one_epoch(data.select(range(opts.batch)), 1, False, opts)  # warm-up
    print(f"{'k':>2}  {'uncached s/epoch':>16}  {'cached 1st epoch':>16}  {'cached later':>12}  "
          f"{'speed-up 1st':>12}  {'speed-up later':>14}  load avg (1 min)")
    for k in (1, 2):
        clear_feature_cache()
        plain = one_epoch(data, k, False, opts)
        first = one_epoch(data, k, True, opts)
        later = one_epoch(data, k, True, opts)
        print(f"{k:>2}  {plain:>16.2f}  {first:>16.2f}  {later:>12.2f}  {plain / first:>11.2f}×  "
              f"{plain / later:>13.2f}×  {os.getloadavg()[0]:.1f}")
    clear_feature_cache()


if __name__ == "__main__":
    main()
