"""Public-data preconditioning of a linear probe's input (`DPTrainingArguments(probe_preconditioning=...)`).

The probe trains on z = Pᵀ D⁻¹ (x − μ) instead of the backbone's features x: μ and D (per-feature standard
deviations) and P (the top K principal directions of the standardised features, d × K, orthonormal columns) are
fitted on the PUBLIC training set's features only, so they cost no ε. With "pca:K" DP-SGD then trains a K × C head
and its noise lives in K dimensions instead of d. Values:
- "none" (default): the probe sees x;
- "standardize": μ and D, P = I (K = d);
- "pca:K": standardise, then project on the top K principal directions.

What is saved is a plain head of the model's own shape: the trained head (W, b) on z is folded into
W' = W Pᵀ D⁻¹, b' = b − W' μ, so `from_pretrained` + `predict` apply the preconditioning with no extra code, and
unfolded again (W = W' D P, b = b' + W' μ) when training resumes from a checkpoint (equal up to float rounding).

Example:
    >>> import torch
    >>> from hf_dp_repr.scope.preconditioning import fit_preconditioner
    >>> public = torch.randn(200, 6) * torch.tensor([1., 10., 1., 1., 1., 1.]) + 3
    >>> pre = fit_preconditioner(public, "pca:2")
    >>> pre(public).shape, bool(pre(public).mean(0).abs().max() < 1e-5)
    (torch.Size([200, 2]), True)
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DPConfigError
from .shards import assign, is_dtensor, whole

PRECONDITIONINGS = ("none", "standardize", "pca:K")
_EPS = 1e-6  # added to the standard deviations: a constant feature is centred, not blown up


def parse_preconditioning(value: str) -> tuple[str, int | None]:
    """("none" | "standardize" | "pca", K or None), or DPConfigError naming the accepted values."""
    if value in ("none", "standardize"):
        return value, None
    if isinstance(value, str) and value.startswith("pca:") and value[4:].isdigit() and int(value[4:]) >= 1:
        return "pca", int(value[4:])
    raise DPConfigError(f"DPTrainingArguments: probe_preconditioning={value!r}; use 'none', 'standardize' or "
                        "'pca:K' (K >= 1 principal directions of the public features, e.g. 'pca:32').")


class Preconditioner(nn.Module):
    """x ↦ Pᵀ D⁻¹ (x − μ) (buffers only: nothing here trains)."""

    def __init__(self, mean: torch.Tensor, scale: torch.Tensor, components: torch.Tensor | None):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("scale", scale)
        self.register_buffer("components", components)  # (d, K), or None for standardisation alone
        self.width: int | None = None  # set: z is padded with zeros to this many features (a sharded head, `install`)

    @property
    def dims(self) -> int:
        """K: the features z carries."""
        return len(self.mean) if self.components is None else self.components.shape[1]

    @property
    def out_features(self) -> int:
        return self.width or self.dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.mean) / self.scale
        z = z if self.components is None else z @ self.components
        return z if self.width is None else nn.functional.pad(z, (0, self.width - self.dims))

    def _linear_map(self) -> torch.Tensor:
        """M (d × K) with z = (x − μ) M."""
        eye = torch.diag(1 / self.scale)
        return eye if self.components is None else eye @ self.components

    @torch.no_grad()
    def fold(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head (C × K, C) on z as a head (C × d, C) on x (a padded head's columns past K see only zeros)."""
        weight = weight[:, :self.dims]
        folded = (weight.double() @ self._linear_map().double().T).to(weight.dtype)
        return folded, None if bias is None else (bias.double() - folded.double() @ self.mean.double()).to(bias.dtype)

    @torch.no_grad()
    def unfold(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A head (C × d) on x as a head (C × K) on z (padded with zero columns to `width`); the inverse of `fold`
        (P has orthonormal columns)."""
        back = torch.diag(self.scale.double())
        if self.components is not None:
            back = back @ self.components.double()
        inner = (weight.double() @ back).to(weight.dtype)
        if self.width is not None:
            inner = nn.functional.pad(inner, (0, self.width - self.dims))
        return inner, None if bias is None else (bias.double() + weight.double() @ self.mean.double()).to(bias.dtype)


def fit_preconditioner(features: torch.Tensor, spec: str) -> Preconditioner | None:
    """Fit μ, D (and P) on `features` (n × d, PUBLIC data only), in float64; None for "none"."""
    kind, k = parse_preconditioning(spec)
    if kind == "none":
        return None
    x = features.double().reshape(len(features), -1)
    mean = x.mean(0)
    scale = x.std(0, unbiased=False) + _EPS
    components = None
    if kind == "pca":
        if k > min(x.shape):
            raise DPConfigError(f"DPTrainer: probe_preconditioning='pca:{k}' needs K <= min(public examples, "
                                f"features) = {min(x.shape)}; lower K or give more public data.")
        _, _, vh = torch.linalg.svd((x - mean) / scale, full_matrices=False)
        components = vh[:k].T.contiguous()
        components *= torch.where(components.abs().amax(0) == components.amax(0), 1.0, -1.0)  # a fixed sign
    dtype = features.dtype
    return Preconditioner(mean.to(dtype), scale.to(dtype), None if components is None else components.to(dtype))


class PreconditionedHead(nn.Sequential):
    """(Preconditioner, the head's own Linear with the same Parameter objects, reshaped to K inputs)."""


def install(model: nn.Module, head_name: str, pre: Preconditioner) -> None:
    """Put `pre` in front of the Linear head `head_name`, its parameters unfolded in place (the same Parameter
    objects: the scope, optimizer and clipper keep pointing at them).

    A head sharded by FSDP2 keeps its shape (FSDP2 fixes it when it shards): z is padded with zeros to the d inputs
    and so is the head's unfolded weight. The columns past K then see only zeros: their per-example gradients are
    exactly 0 (clipping sees the norms of the K × C head), their noise never reaches an output, and `fold` drops them;
    the first K columns train as the K × C head does. Every rank calls this (a collective when sharded)."""
    head = model.get_submodule(head_name)
    if not isinstance(head, nn.Linear):
        raise DPConfigError(f"DPTrainer: probe_preconditioning needs a Linear head; `{head_name}` is a "
                            f"{type(head).__name__}. Use probe_preconditioning='none'.")
    pre = pre.to(head.weight.device)
    if is_dtensor(head.weight):
        pre.width = head.in_features
    _set_head(head, *pre.unfold(*_head_values(head)))
    model.set_submodule(head_name, PreconditionedHead(pre, head))


def remove(model: nn.Module, head_name: str) -> tuple[Preconditioner, nn.Linear] | None:
    """Fold the preconditioning back into the plain Linear head (in place); returns (the preconditioner, the head).
    Every rank calls this (a collective when sharded)."""
    wrapped = model.get_submodule(head_name)
    if not isinstance(wrapped, PreconditionedHead):
        return None
    pre, head = wrapped[0], wrapped[1]
    _set_head(head, *pre.fold(*_head_values(head)))
    model.set_submodule(head_name, head)
    return pre, head


def _head_values(head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return whole(head.weight), None if head.bias is None else whole(head.bias)


def _set_head(head: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    assign(head.weight, weight)
    if bias is not None:
        assign(head.bias, bias)
    head.in_features = head.weight.shape[1]
