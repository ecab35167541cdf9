"""Where DP-SGD's random draws come from: the Gaussian noise and the Poisson batches.

Both must stay secret. Whoever can replay the noise can subtract it from the released weights, and whoever
knows which examples each batch held loses nothing to the subsampling that the accountant counts as
amplification. So they never follow `TrainingArguments.seed` (public, and stored in training_args.bin): each run
draws a 128-bit secret from the operating system (`secrets`), holds it in memory only (never in checkpoints,
logs or pushes), and keys every draw on (secret, purpose, step or epoch), so no two steps share a draw and a
resumed run draws afresh. With several processes, rank 0's secret is broadcast so all ranks draw the same batch.

`noise_seed` replaces the secret for tests and experiments that must be reproducible. Such a run is NOT
private (anyone who knows the seed can remove the noise); the trainer warns, and the ledger and card say so.

Example:
    >>> from hf_dp_repr.privacy.randomness import DPRandomness
    >>> a, b = DPRandomness(), DPRandomness()
    >>> bool((a.noise_generator(0).initial_seed() != b.noise_generator(0).initial_seed()))
    True
    >>> seeded = DPRandomness(noise_seed=7)
    >>> seeded.noise_generator(3).initial_seed() == DPRandomness(noise_seed=7).noise_generator(3).initial_seed()
    True
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
import torch.distributed as dist

# Purposes: one stream each, so a seed never ties the batches to the noise. A shard's noise has its own purpose:
# SeedSequence keys [..., step] and [..., step, 0] give the same state (trailing zero words do not change it).
_NOISE, _SAMPLING, _SHARD_NOISE = 1, 2, 3
_CANARIES = 4  # the secrets of an exposure audit's canaries (hf_dp_repr.audit.exposure)
_COUNT_NOISE = 5  # adaptive clipping: the noise of each step's count (`privacy.adaptive_clipping`)


class DPRandomness:
    """The secret behind a run's DP draws: OS entropy by default, `noise_seed` when given (not private)."""

    def __init__(self, noise_seed: int | None = None, world_size: int = 1):
        self.seeded = noise_seed is not None
        secret = int(noise_seed) if self.seeded else secrets.randbits(128)
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            shared = [secret]
            dist.broadcast_object_list(shared, src=0)
            secret = shared[0]
        self._secret = secret

    @property
    def kind(self) -> str:
        """What the ledger and the model card record: "seeded" or "os-entropy"."""
        return "seeded" if self.seeded else "os-entropy"

    def _key(self, purpose: int, *index: int) -> np.random.SeedSequence:
        return np.random.SeedSequence([self._secret, purpose, *(int(i) for i in index)])

    def noise_generator(self, step: int, device: torch.device | str = "cpu", shard: int | None = None
                        ) -> torch.Generator:
        """A torch generator on `device` for the Gaussian noise of DP step `step`, fresh for every step. `shard`:
        the stream of one shard of the parameters (sharded runs: each rank noises the coordinates it owns); None,
        the whole step's stream (keyed as before shards existed, so seeded runs reproduce)."""
        key = self._key(_NOISE, step) if shard is None else self._key(_SHARD_NOISE, step, shard)
        seed = int(key.generate_state(1, np.uint64)[0])
        return torch.Generator(device=device).manual_seed(seed)

    def count_noise_generator(self, step: int) -> torch.Generator:
        """A CPU generator for the noise of step `step`'s adaptive-clipping count: its own stream, so it never
        repeats a draw of the step's gradient noise (a generator of that stream made again would)."""
        seed = int(self._key(_COUNT_NOISE, step).generate_state(1, np.uint64)[0])
        return torch.Generator().manual_seed(seed)

    def sampling_seed(self) -> int:
        """A 128-bit seed for the batch sampler, which keys its draws on it and the epoch."""
        words = self._key(_SAMPLING, 0).generate_state(4, np.uint32)
        return sum(int(w) << (32 * i) for i, w in enumerate(words))

    def canary_generator(self) -> np.random.Generator:
        """The generator of an exposure audit's canary secrets: its own purpose, so knowing the canaries tells
        nothing of the noise or the batches (and the reverse)."""
        return np.random.default_rng(self._key(_CANARIES, 0))
