"""Canary exposure (Carlini et al. 2019, "The Secret Sharer"): how much a language model remembers of a secret
it saw r times in training.

A canary is a sentence of a fixed format with a secret of k random symbols, e.g. "the secret code of maple is
4 7 1 9". After training, every candidate secret r of the space R (all |alphabet|^k fillings of the format) is
scored by the model's log-perplexity of the filled sentence, and

    exposure = log2 |R| − log2 rank(secret),

rank 1 = the lowest log-perplexity. A model that never saw the secret ranks it uniformly at random: its exposure
is ~ log2 e ≈ 1.44 bits on average (`RANDOM_LEVEL`), and above b bits with probability 2^−b. A secret ranked first
has the largest exposure, log2 |R|. `exposure` computes the rank exactly when |R| ≤ `exact_limit` (every candidate
scored), else by the paper's extrapolation: the log-perplexities of a uniform sample of candidates are fitted by a
skew-normal distribution, and exposure = −log2 CDF(log-perplexity of the secret).

The secrets come from the run's secret randomness (`DPRandomness.canary_generator`, a purpose of its own): nothing
on the command line or beside the model can reproduce them, and they are never written. Each canary's prefix (a
word of `CANARY_NAMES`) is public: it tells the canaries apart, so the model cannot confuse two secrets.

Example (an untrained tiny model ranks the secret anywhere: exposure is small):
    >>> from hf_dp_repr.data.tokenizer import train_tokenizer
    >>> from hf_dp_repr.privacy.randomness import DPRandomness
    >>> from hf_dp_repr.tiny import tiny_gpt2
    >>> canaries = draw_canaries(DPRandomness(noise_seed=0), repeats=(4,), length=3)
    >>> tok = train_tokenizer(["the secret code of maple is 1 2 3"] * 5, vocab_size=300)
    >>> model = tiny_gpt2(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    >>> result = exposure(model, tok, canaries[0])
    >>> result["method"], result["candidates"], 0 <= result["exposure"] <= math.log2(1000)
    ('exact', 1000, True)
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
from dataclasses import dataclass

import numpy as np

from ..data.tokenizer import start_ids
from ..errors import ArgumentError

DIGITS = "0123456789"
CANARY_FORMAT = "the secret code of {name} is {secret}"
# Public words that tell the canaries apart (each canary has its own prefix; which secret follows is the secret).
CANARY_NAMES = ("maple", "river", "copper", "lantern", "orchid", "falcon", "granite", "harbor", "willow", "ember",
                "glacier", "meadow", "saffron", "thistle", "cobalt", "juniper")
RANDOM_LEVEL = 1 / math.log(2)  # E[−log2 U] for U uniform: a never-seen secret's expected exposure, in bits
EXACT_LIMIT = 20_000
SAMPLES = 5_000


@dataclass(frozen=True)
class Canary:
    """One canary: a public `name` (its prefix), a secret of symbols, and how often it was put in the training
    text (`repeats`; 0 = never, a reference for the random level)."""

    name: str
    secret: tuple[str, ...]
    repeats: int
    alphabet: str = DIGITS

    @property
    def prefix(self) -> str:
        return CANARY_FORMAT.format(name=self.name, secret="").rstrip()

    @property
    def text(self) -> str:
        return self.prefix + fill(self.secret)

    @property
    def space_size(self) -> int:
        return len(self.alphabet) ** len(self.secret)

    def public(self) -> dict:
        """What a report may say of this canary: everything but its secret."""
        return {"name": self.name, "repeats": self.repeats, "secret_length": len(self.secret),
                "alphabet": self.alphabet, "candidates": self.space_size, "format": CANARY_FORMAT}


def fill(symbols) -> str:
    """The secret part of a canary's text: each symbol after a space (" 4 7 1 9")."""
    return "".join(" " + s for s in symbols)


def draw_canaries(randomness, repeats=(1, 4, 16), per_repeat: int = 1, never_inserted: int = 1, length: int = 6,
                  alphabet: str = DIGITS) -> list[Canary]:
    """`per_repeat` canaries for each repetition count in `repeats` and `never_inserted` references (repeats 0),
    their secrets drawn uniformly from `alphabet`^`length` with `randomness.canary_generator()` (a `DPRandomness`:
    the run's secret, or its `noise_seed` in tests)."""
    counts = [r for r in repeats for _ in range(per_repeat)] + [0] * never_inserted
    if any(int(r) != r or r < 0 for r in repeats) or not counts:
        raise ArgumentError(f"canaries: repeats must be positive integers, got {list(repeats)}")
    if len(counts) > len(CANARY_NAMES):
        raise ArgumentError(f"canaries: {len(counts)} canaries asked for, at most {len(CANARY_NAMES)} (one public name "
                            "each); lower per_repeat or never_inserted")
    if length < 1 or len(set(alphabet)) != len(alphabet) or len(alphabet) < 2 or " " in alphabet:
        raise ArgumentError(f"canaries: need length ≥ 1 and ≥ 2 distinct symbols without spaces, got length={length}, "
                            f"alphabet={alphabet!r}")
    rng = randomness.canary_generator()
    symbols = rng.integers(0, len(alphabet), size=(len(counts), length))
    return [Canary(CANARY_NAMES[i], tuple(alphabet[j] for j in row), int(r), alphabet)
            for i, (r, row) in enumerate(zip(counts, symbols))]


def log_perplexities(model, tokenizer, prefix: str, fillings: list[tuple[str, ...]], batch_size: int = 1024
                     ) -> np.ndarray:
    """−Σ log2 p(token | earlier tokens) over the tokens of each filling (a tuple of symbols, written by `fill`)
    after `prefix`, one value per filling, in order. The prefix is the same for every candidate (it does not change
    their order): it runs once and its key/value cache is shared by the batch."""
    import torch

    device = next(model.parameters()).device
    head = torch.tensor([start_ids(tokenizer) + tokenizer(prefix, add_special_tokens=False)["input_ids"]],
                        device=device)
    rows = _filling_ids(tokenizer, fillings)
    # transformers ≥ 5.2x names the cache `cache` (`past_key_values` is deprecated); older versions the latter
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = np.empty(len(rows))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        first = model(input_ids=head, attention_mask=torch.ones_like(head), use_cache=True)
        first_logp = torch.log_softmax(first.logits[0, -1].float(), -1)
        # a chunk's logits are rows × tokens × vocabulary floats: with a real vocabulary (SmolLM2's 49,152) 1,024
        # rows made the audit peak at 11 GB; chunks are cut to ~2^26 logits (the values do not change)
        batch_size = max(1, min(batch_size, (1 << 26) // (max(map(len, rows), default=1) * first_logp.numel())))
        for lo in range(0, len(rows), batch_size):
            chunk = rows[lo:lo + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([r + [0] * (width - len(r)) for r in chunk], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk], device=device)
            cache = copy.deepcopy(getattr(first, "cache", None) or first.past_key_values)
            cache.batch_repeat_interleave(len(chunk))
            full_mask = torch.cat([torch.ones(len(chunk), head.shape[1], dtype=mask.dtype, device=device), mask], 1)
            logits = model(input_ids=ids, attention_mask=full_mask, **{cache_arg: cache}).logits[:, :-1]
            later = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            token_logp = torch.cat([first_logp[ids[:, :1]], later], 1) * mask
            out[lo:lo + len(chunk)] = (-token_logp.sum(1) / math.log(2)).cpu().numpy()
    model.train(was_training)
    return out


def _filling_ids(tokenizer, fillings: list[tuple[str, ...]]) -> list[list[int]]:
    """Token ids of each filling: its symbols' own ids joined when that is how the tokenizer splits the filling
    (checked on the first 64: byte-level BPE splits at the spaces), else each filling tokenised whole."""
    def whole(f):
        return tokenizer(fill(f), add_special_tokens=False)["input_ids"]

    pieces = {s: whole((s,)) for s in sorted({s for f in fillings for s in f})}
    if all(sum((pieces[s] for s in f), []) == whole(f) for f in fillings[:64]):
        return [sum((pieces[s] for s in f), []) for f in fillings]
    return [whole(f) for f in fillings]


def exposure(model, tokenizer, canary: Canary, *, exact_limit: int = EXACT_LIMIT, samples: int = SAMPLES,
             batch_size: int = 1024, rng: np.random.Generator | None = None) -> dict:
    """The exposure of `canary`'s secret under `model`: {"exposure", "rank" (exact only), "candidates" |R|,
    "method": "exact" | "extrapolated", "log_perplexity"}. Exact: rank = 1 + the candidates of lower log-perplexity
    (+ half of those tied with the secret). `rng` draws the candidates of the extrapolation (they are public: any
    generator will do)."""
    size, k, alphabet = canary.space_size, len(canary.secret), canary.alphabet
    if size <= exact_limit:
        everyone = log_perplexities(model, tokenizer, canary.prefix, list(itertools.product(alphabet, repeat=k)),
                                    batch_size)
        secret_lp = everyone[sum(alphabet.index(s) * len(alphabet) ** (k - 1 - i) for i, s in enumerate(canary.secret))]
        rank = 1 + int(np.sum(everyone < secret_lp)) + (int(np.sum(everyone == secret_lp)) - 1) / 2
        return {"exposure": math.log2(size) - math.log2(rank), "rank": rank, "candidates": size, "method": "exact",
                "log_perplexity": float(secret_lp)}
    from scipy.stats import skewnorm

    rng = rng if rng is not None else np.random.default_rng(0)
    picks = [tuple(alphabet[j] for j in row) for row in rng.integers(0, len(alphabet), size=(samples, k))]
    lps = log_perplexities(model, tokenizer, canary.prefix, [canary.secret] + picks, batch_size)
    secret_lp, sample = lps[0], lps[1:]
    shape, loc, scale = skewnorm.fit(sample)
    log_cdf = float(skewnorm.logcdf(secret_lp, shape, loc, scale))  # ln Pr[a candidate has a lower log-perplexity]
    value = min(math.log2(size), max(0.0, -log_cdf / math.log(2)))
    return {"exposure": value, "candidates": size, "method": "extrapolated", "samples": samples,
            "log_perplexity": float(secret_lp)}


def exposures(model, tokenizer, canaries: list[Canary], **kwargs) -> list[dict]:
    """`exposure` of each canary, with its public description (never its secret)."""
    return [{**c.public(), **exposure(model, tokenizer, c, **kwargs)} for c in canaries]
