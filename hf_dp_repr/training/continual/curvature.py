"""Curvature on PUBLIC data: Hutchinson's estimate of the Hessian trace tr(H) and the "decelerator" of seed 004.

Hutchinson: for Rademacher probes v (entries ±1), E[vᵀHv] = tr(H) and Var[vᵀHv] = 2(‖H‖_F² − Σ_i H_ii²) ≤ 2‖H‖_F²,
so the mean of m probes has standard error ≤ sqrt(2/m)·‖H‖_F. Each probe costs one Hessian-vector product (double
backward through the loss).

Seed 004 (Bu et al. 2024) expands the loss after one DP-SGD step w ← w − η·ĝ, with this library's update
ĝ = (Σ_i clip_C(g_i) + N(0, σ²C²I)) / B, to second order (ḡ = E[ĝ] the mean clipped gradient, G the loss gradient):
    E[ΔL] ≈ −η·Gᵀḡ + (η²/2)·(ḡᵀHḡ + D),     D = σ²C²·tr(H) / B²  (the "decelerator")
(seed 004 writes it σ²tr(H)/(B c²) in its normalisation of the clipped gradient; here the noise std of the
update is σC/B; the sampling variance of the clipped mean is left out, as DP noise dominates it). At the best
step size η* = Gᵀḡ / (ḡᵀHḡ + D) the decrease is (Gᵀḡ)² / (2(ḡᵀHḡ + D)): the noise keeps a fraction
ḡᵀHḡ / (ḡᵀHḡ + D) of the non-private progress, and `decelerator_ratio` = D / ḡᵀHḡ says how far from 1 it is.
Public → private training (`DPTrainer(public_train_dataset=...)`) can switch to DP-SGD once that ratio is small,
i.e. when the noise term has become small against the first-order decrease it leaves.

Example:
    >>> import torch
    >>> from hf_dp_repr.training.continual.curvature import hutchinson_trace
    >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> trace, stderr = hutchinson_trace(lambda: (w ** 2).sum() + w[0] * w[1], [w], num_probes=8)
    >>> abs(trace - 4) <= 2, stderr < 1  # H = [[2, 1], [1, 2]], tr = 4; each vᵀHv is 2 or 6
    (True, True)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from transformers import TrainerCallback, default_data_collator

from ...errors import ArgumentError, DataError


def hutchinson_trace(loss_fn: Callable[[], torch.Tensor], params: list[torch.Tensor], num_probes: int = 16,
                     generator: torch.Generator | None = None) -> tuple[float, float]:
    """(estimate of tr(∇² loss) over `params`, its standard error) from `num_probes` Rademacher probes."""
    loss = loss_fn()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    values = []
    for _ in range(num_probes):
        probes = [torch.randint(0, 2, p.shape, generator=generator, device="cpu").to(p.device, p.dtype) * 2 - 1
                  for p in params]
        hvp = torch.autograd.grad(grads, params, grad_outputs=probes, retain_graph=True)
        values.append(sum((v * h).sum() for v, h in zip(probes, hvp)).item())
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((x - mean) ** 2 for x in values) / max(1, len(values) - 1))
    return mean, spread / math.sqrt(len(values))


def decelerator(trace: float, noise_multiplier: float, max_grad_norm: float, expected_batch: int) -> float:
    """σ²·C²·tr(H) / B²: the expected loss increase from DP noise in one step, per η²/2."""
    return noise_multiplier ** 2 * max_grad_norm ** 2 * trace / expected_batch ** 2


def decelerator_ratio(trace: float, curvature_along_gradient: float, *, noise_multiplier: float,
                      max_grad_norm: float, expected_batch: int) -> float:
    """D / ḡᵀHḡ with D = σ²C²tr(H)/B² (∞ when ḡᵀHḡ ≤ 0: no best step size, the expansion says nothing).
    A DP step at its best step size keeps 1 / (1 + ratio) of the non-private per-step decrease."""
    if curvature_along_gradient <= 0:
        return math.inf
    return decelerator(trace, noise_multiplier, max_grad_norm, expected_batch) / curvature_along_gradient


def _trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def _plain_autograd(model, hooks=None):
    """Eval mode (no dropout noise in the curvature), Opacus' per-sample hooks off, and the math attention kernel
    (fused CPU attention has no double backward), restored afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    was_training = model.training
    model.eval()
    if hooks is not None:
        hooks.disable_hooks()
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        if hooks is not None:
            hooks.enable_hooks()
        model.train(was_training)


def public_batch(dataset, max_examples: int, collator=None, device=None) -> dict:
    """The first `max_examples` rows of a public dataset, collated and moved to `device`."""
    rows = [dataset[i] for i in range(min(max_examples, len(dataset)))]
    batch = (collator or default_data_collator)(rows)
    return {k: v.to(device) if isinstance(v, torch.Tensor) and device is not None else v for k, v in batch.items()}


def model_trace(model, batch: dict, num_probes: int = 16, generator: torch.Generator | None = None,
                hooks=None) -> tuple[float, float]:
    """Hutchinson tr(H) of the model's own (mean) loss on `batch`, over its trainable parameters."""
    with _plain_autograd(model, hooks):
        return hutchinson_trace(lambda: model(**batch).loss, _trainable(model), num_probes, generator)


def clipped_gradient_terms(model, batch: dict, max_grad_norm: float, hooks=None) -> tuple[float, float]:
    """(Gᵀḡ, ḡᵀHḡ) on a public batch: G the gradient of the mean loss, ḡ the mean of per-example gradients clipped
    to C (each example back-propagated alone: meant for a small public batch), H the Hessian of the mean loss."""
    params = _trainable(model)
    with _plain_autograd(model, hooks):
        full = torch.autograd.grad(model(**batch).loss, params, create_graph=True)
        n = len(next(v for v in batch.values() if isinstance(v, torch.Tensor)))
        clipped = [torch.zeros_like(p) for p in params]
        for i in range(n):
            one = {k: v[i:i + 1] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            grads = [g.detach() for g in torch.autograd.grad(model(**one).loss, params)]
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
            factor = min(1.0, max_grad_norm / (norm + 1e-6))
            clipped = [c + g * factor / n for c, g in zip(clipped, grads)]
        hvp = torch.autograd.grad(full, params, grad_outputs=clipped)
    first = float(sum((g.detach() * c).sum() for g, c in zip(full, clipped)))
    return first, float(sum((h * c).sum() for h, c in zip(hvp, clipped)))


class HessianTraceCallback(TrainerCallback):
    """Every `every_n_steps` optimizer steps (and at the first), estimates tr(H) of the training loss on a PUBLIC
    batch (the first `max_examples` rows of `dataset`) with `num_probes` Rademacher probes, and logs
    `hessian_trace` and `hessian_trace_stderr`. Works with any `transformers.Trainer`; with `DPTrainer` the
    per-sample hooks are paused during the estimate. Never give it private data: its value is logged as is.

    Example:
        >>> from transformers import Trainer, TrainingArguments
        >>> from hf_dp_repr.training.continual.curvature import HessianTraceCallback
        >>> from hf_dp_repr.data import load_digits_dataset
        >>> from hf_dp_repr.tiny import tiny_vit
        >>> ds = load_digits_dataset()
        >>> cb = HessianTraceCallback(ds["test"], every_n_steps=2, num_probes=2, max_examples=16)
        >>> args = TrainingArguments("/tmp/htc-doc", max_steps=2, report_to="none", save_strategy="no",
        ...                          disable_tqdm=True, logging_steps=1)
        >>> _ = Trainer(model=tiny_vit(), args=args, train_dataset=ds["train"], callbacks=[cb]).train()
        {...}
        >>> [step for step, _, _ in cb.history]
        [1, 2]
    """

    def __init__(self, dataset, every_n_steps: int = 50, num_probes: int = 16, max_examples: int = 64,
                 data_collator=None, seed: int = 0):
        if every_n_steps < 1 or num_probes < 1 or max_examples < 1:
            raise ArgumentError("HessianTraceCallback: every_n_steps, num_probes and max_examples must be >= 1.")
        self.dataset, self.every_n_steps, self.num_probes = dataset, every_n_steps, num_probes
        self.max_examples, self.data_collator, self.seed = max_examples, data_collator, seed
        self.history: list[tuple[int, float, float]] = []  # (global step, tr(H), standard error)
        self._trainer = None
        self._pending: dict | None = None

    def attach(self, trainer) -> None:
        """Called by DPTrainer: refuse the private training set, and pause its per-sample hooks when estimating."""
        if self.dataset is trainer.train_dataset:
            raise DataError("HessianTraceCallback: the dataset is the private training set; its tr(H) would be "
                            "logged outside DP-SGD. Give it public data.")
        self._trainer = trainer

    def estimate(self, model, offset: int = 0) -> tuple[float, float]:
        """(tr(H), standard error) of `model` on the public batch now; probes seeded by (seed, offset)."""
        device = next(model.parameters()).device
        batch = public_batch(self.dataset, self.max_examples, self.data_collator, device)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + offset)
        hooks = getattr(getattr(self._trainer, "engine", None), "clipper", None)  # DPTrainer's: paused meanwhile
        return model_trace(model, batch, self.num_probes, generator, hooks)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step == 1 or step % self.every_n_steps == 0:
            trace, stderr = self.estimate(model, step)
            self.history.append((step, trace, stderr))
            self._pending = {"hessian_trace": trace, "hessian_trace_stderr": stderr}
            control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending is not None and logs is not None:
            logs.update(self._pending)
            if state.log_history:
                state.log_history[-1].update(self._pending)
            self._pending = None
