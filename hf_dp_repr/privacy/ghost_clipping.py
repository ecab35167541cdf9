"""Fast per-example clipping: ghost norms and book-keeping in one backward pass.

Opacus' hooks materialise a gradient per example for every trained tensor (memory batch × parameters). This
engine keeps, for every module that owns a trained tensor, its input `a` and the gradient `g` of the loss with
respect to its output, and nothing per example of parameter size:

- a linear map's per-example gradient is a sum of outer products G_i = Σ_t L_it ⊗ R_it (Linear: L = g, R = a;
  transformers' Conv1D: L = a, R = g; Embedding: L = one-hot(token), R = g; Conv2d: on unfolded patches), so its
  squared norm is the "ghost norm" Σ_{t,s} (L_it·L_is)(R_it·R_is), a T×T computation. A tensor used several times
  (GPT-2's wte tied to lm_head) is one tensor: its uses are summed per example *before* the norm, by adding the
  cross terms Σ_{t,s} (L_ut·L_vs)(R_ut·R_vs) of every pair of uses. Per layer the engine forms the explicit
  per-example gradient instead when it is no larger than the factors (p·q ≤ T·(p+q)): then it costs less too;
- small tensors (biases, norms' scales, ViT's cls/position embeddings) get explicit per-example gradients, from
  Opacus' registered grad samplers where one exists;
- explicit gradients are formed in the backward, as soon as a module's output gradient arrives, and the module's
  input and output gradient are dropped then (a LayerNorm keeps (B, d), not (B, T, d) twice);
- book-keeping (Bu et al., "Differentially private optimization on large model at small cost"): during the forward
  and backward the trained tensors are marked `requires_grad=False`, so autograd never forms the unclipped summed
  gradient; after the backward, all norms give the clip factors c_i, and each tensor's clipped sum
  Σ_i c_i G_i = (c·L)ᵀR is one matmul, the one the non-private backward would have done. No second backward;
- units of privacy (several rows clipped as one, `squared_norms(groups=...)`): a unit's gradient is that of one
  example whose tokens are its rows' tokens, so the same Grams on the rows concatenated along T give its norm with
  every cross-row term; each row then takes its unit's clip factor, and the clipped sums stay per row (exact).

What each kind of module supports and how its pieces (factors L, R or an explicit per-example gradient) are
computed is its rule in `ghost_rules.py` (`register_ghost_rule` adds one; Opacus' registered rules come last).

Only modules that own a trained tensor are hooked: with `trainable_blocks=k` nothing below the scope is touched and
autograd stops where the trained part starts.

Example (norms equal those of the per-example gradients):
    >>> import torch
    >>> layer = torch.nn.Linear(4, 3)
    >>> engine = GhostClippingEngine(layer)
    >>> x = torch.randn(5, 7, 4)
    >>> with engine.recording():
    ...     layer(x).pow(2).sum().backward()
    >>> norms = engine.squared_norms()[layer.weight]
    >>> grads = [torch.autograd.grad(layer(x[i]).pow(2).sum(), layer.weight)[0] for i in range(5)]
    >>> brute = torch.stack([g.pow(2).sum() for g in grads])
    >>> torch.allclose(norms, brute, rtol=1e-5)
    True
    >>> engine.remove()
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ArgumentError, ArgumentTypeError, UnsupportedError
from . import ghost_rules, modules  # noqa: F401 (modules: every family's ghost rules are registered)
from .ghost_rules import OneHot, at_least_f32, pieces_of, saved_inputs


def _own_trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the engine cannot clip this model exactly (None when it can)."""
    # transformers 5 renamed is_gradient_checkpointing, whose old name now warns when read: read it only if older
    checkpointing = (model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing")
                     else getattr(model, "is_gradient_checkpointing", False))
    if checkpointing:
        return "gradient checkpointing re-runs the forward inside the backward"
    for name, module in model.named_modules():
        if _own_trainable(module) and (reason := ghost_rules.unsupported(module)) is not None:
            return f"{name} ({type(module).__name__}) {reason}"
    return None


def _gram(x, y) -> torch.Tensor:
    """(B, Tx, Ty) inner products of the rows of two factors (dense (B, T, d) or OneHot)."""
    if isinstance(x, OneHot) and isinstance(y, OneHot):
        return (x.ids[:, :, None] == y.ids[:, None, :]).to(torch.float32)
    if isinstance(x, OneHot):
        return torch.gather(y, 2, x.ids[:, None, :].expand(-1, y.shape[1], -1)).transpose(1, 2)
    if isinstance(y, OneHot):
        return _gram(y, x).transpose(1, 2)
    return torch.bmm(x, y.transpose(1, 2))


def _batched_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_{t,s} x_bts·y_bts per b (vecdot: a fused multiply-add per row; a (1, T²)×(T², 1) bmm per example ran
    ten times slower on CPU, measured on GPT-2 124M's T = 256 Grams)."""
    dtype = torch.promote_types(x.dtype, y.dtype)
    b = x.shape[0]
    return torch.linalg.vecdot(x.reshape(b, -1).to(dtype), y.reshape(b, -1).to(dtype))


def _weighted_sum(c: torch.Tensor, left, right: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i c_i Σ_t L_it ⊗ R_it, flattened (p·q,); added in place to `into` (a flat (p·q,) sum) when given."""
    if isinstance(left, OneHot):  # the rows of the ids looked up, added where they belong
        weighted = (right * c[:, None, None]).flatten(0, 1)
        if into is not None and torch.promote_types(into.dtype, weighted.dtype) == into.dtype:
            return into.view(left.rows, -1).index_add_(0, left.ids.flatten(), weighted.to(into.dtype)).view(-1)
        out = torch.zeros(left.rows, right.shape[-1], dtype=weighted.dtype, device=right.device)
        return _add_into(into, out.index_add_(0, left.ids.flatten(), weighted).view(-1))
    if left.shape[-1] <= right.shape[-1]:  # scale the smaller factor
        left = left * c[:, None, None].to(left.dtype)
    else:
        right = right * c[:, None, None].to(right.dtype)
    return _add_into(into, (left.flatten(0, 1).transpose(0, 1) @ right.flatten(0, 1)).view(-1))


def _add_into(into: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    """into + term, in place when the sum keeps `into`'s dtype (`into` is a fresh sum owned by the caller)."""
    if into is None:
        return term
    return into.add_(term) if torch.promote_types(into.dtype, term.dtype) == into.dtype else into + term


def _materialise_now(left, right) -> bool:
    """Whether a linear map's per-example gradient (B, p·q) is no larger than its factors (B, T, p + q): then it
    is formed in the backward (one matmul per example, plus c·G for the clipped sum) and the factors are freed,
    which costs less than the T×T Grams plus the book-kept matmul and holds no more memory."""
    if isinstance(left, OneHot):
        return False
    t, p, q = left.shape[1], left.shape[2], right.shape[2]
    return p * q <= t * (p + q)


def _materialise(left, right) -> torch.Tensor:
    """Per-example gradients Σ_t L_it ⊗ R_it, flattened to (B, p·q)."""
    if isinstance(left, OneHot):
        left = F.one_hot(left.ids, left.rows).to(right.dtype)
    return torch.einsum("btp,btq->bpq", left, right).reshape(left.shape[0], -1)


class _Regroup:
    """Rows → groups of rows (units of privacy) for the norms. A group's gradient Σ_r Σ_t L_rt ⊗ R_rt is one example
    whose tokens are its rows' tokens: factors (B, T, d) become (G, m·T, d), each group's rows side by side (m: the
    most rows of a group), zero where a group has fewer rows. A zero R kills every term it enters, whatever L is
    there (a `OneHot` L is padded with id 0), so the Gram formula gives ||Σ_r G_r||² with all cross-row terms.
    Explicit per-row gradients are summed per group (`sum`). No groups: everything as it is."""

    def __init__(self, groups: torch.Tensor | None):
        self.groups, self._done = groups, {}
        if groups is None:
            return
        self.count = int(groups.max()) + 1 if len(groups) else 0
        sizes = torch.bincount(groups, minlength=self.count)
        order = torch.argsort(groups, stable=True)
        first = torch.cumsum(sizes, 0) - sizes  # where each group starts in `order`
        self.position = torch.empty_like(groups)
        self.position[order] = torch.arange(len(groups), device=groups.device) - first[groups[order]]
        self.most = int(sizes.max()) if len(groups) else 0

    def sum(self, per_row: torch.Tensor) -> torch.Tensor:
        if self.groups is None:
            return per_row
        out = per_row.new_zeros((self.count, *per_row.shape[1:]))
        return out.index_add_(0, self.groups.to(per_row.device), per_row)

    def __call__(self, factor):
        """The factor with each group's rows concatenated along tokens (one object per input: Grams stay cached)."""
        if self.groups is None:
            return factor
        key = id(factor) if isinstance(factor, OneHot) else (factor.data_ptr(), factor.shape, factor.stride(),
                                                               factor.dtype)
        if key not in self._done:
            data = factor.ids if isinstance(factor, OneHot) else factor
            out = data.new_zeros((self.count, self.most, *data.shape[1:]))
            out[self.groups.to(data.device), self.position.to(data.device)] = data
            out = out.reshape(self.count, -1, *data.shape[2:])
            self._done[key] = (factor, OneHot(out, factor.rows) if isinstance(factor, OneHot) else out)
        return self._done[key][1]


class GhostClippingEngine:
    """Records what each trained module needs during one micro-batch's forward and backward, then gives
    per-example squared norms per tensor and clipped sums. `recording()` wraps forward + backward.

    Each use of a module is turned into pieces as soon as its output gradient arrives in the backward: small
    tensors (norms' scales, biases, embeddings' extra parameters) and layers whose per-example gradient is no
    larger than their factors get it computed there, so their inputs and output gradients are freed at once;
    the other linear maps keep their two factors until the clip factors are known.

    `explicit` records, for tests, which tensors took the materialising path (others never hold (B, *shape)).
    `several`: paths of modules that see several rows per example, example-major (OPT's MLP sees (B·T, d); found by
    the probe of `privacy.batch_rows`); their rows are viewed as (B, rows, ...) given `recording(batch_size=B)`.
    """

    def __init__(self, model: nn.Module, several=(), key_of=None):
        self.model = model
        # key_of[(module, attribute)]: the trained tensor a module's parameter stands for (the key of the norms and
        # sums). None: the parameter itself. FSDP2 puts gathered parameters on the modules during forward and
        # backward; key_of (`privacy.sharding.parameter_keys`) maps them back to the sharded ones.
        self.key_of = key_of
        self.several = {m for name, m in model.named_modules() if name in set(several)}
        self._batch_size: int | None = None
        self.modules = [m for m in model.modules() if _own_trainable(m)]
        self.params = [p for m in self.modules for p in _own_trainable(m)]
        self._trained = set(self.params)
        self._recording = False
        self._pieces: dict[nn.Parameter, list] = {}
        self.explicit: set[nn.Parameter] = set()
        self._handles = [m.register_forward_hook(self._forward_hook, with_kwargs=True) for m in self.modules]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.clear()

    def clear(self) -> None:
        self._pieces = {}

    @contextlib.contextmanager
    def recording(self, batch_size: int | None = None):
        """Forward and backward of one micro-batch (of `batch_size` examples: needed with `several`). Trained
        tensors are frozen meanwhile, so autograd computes no parameter gradient (the engine forms the clipped
        one)."""
        self.clear()
        self._batch_size = batch_size
        for p in self.params:
            p.requires_grad_(False)
        self._recording = True
        try:
            yield self
        finally:
            self._recording = False
            for p in self.params:
                p.requires_grad_(True)

    def _forward_hook(self, module, args, kwargs, output):
        if not self._recording or not torch.is_grad_enabled():
            return None
        if not isinstance(output, torch.Tensor):
            raise ArgumentTypeError(f"GhostClippingEngine: {type(module).__name__} returns {type(output).__name__}, "
                                    "not a tensor; use clipping_engine='hooks'.")
        if not output.requires_grad:  # nothing trained below: the gradient starts here
            output = output.detach().requires_grad_(True)
        args = saved_inputs(module, args, kwargs)  # what the module's rule keeps (OPT's positions: their ids)
        saved = tuple(self._examples_first(module, x.detach()) if isinstance(x, torch.Tensor) else x for x in args)
        versions = [x._version for x in saved if isinstance(x, torch.Tensor)]
        # The hook (and what it holds) lives as long as the graph: a use whose output never reaches the loss
        # costs nothing after the backward.
        output.register_hook(functools.partial(self._on_output_grad, module, saved, versions))
        return output

    def _on_output_grad(self, module, inputs, versions, grad) -> None:
        """One use's pieces, from its inputs and output gradient (in the backward pass)."""
        if versions != [x._version for x in inputs if isinstance(x, torch.Tensor)]:
            # autograd would refuse too: the norms would be computed on the wrong activations
            raise UnsupportedError(f"GhostClippingEngine: the input of {type(module).__name__} was modified in place "
                                   "after its forward; use clipping_engine='hooks'.")
        trained, key = self._trained, None
        if self.key_of is not None:  # the live (gathered) parameters → their keys
            key = {p: self.key_of[(module, name)] for name, p in module.named_parameters(recurse=False)}
            trained = {p for p, k in key.items() if k in self._trained}
        for p, kind, *data in pieces_of(module, inputs, self._examples_first(module, grad.detach()), trained):
            if kind == "factors" and _materialise_now(*data):
                kind, data = "explicit", [_materialise(*data)]
            self._pieces.setdefault(p if key is None else key[p], []).append((kind, *data))

    def _examples_first(self, module, t: torch.Tensor) -> torch.Tensor:
        """(B·r, ...) → (B, r, ...) for a module that sees r rows per example; other tensors as they are."""
        if module not in self.several:
            return t
        if self._batch_size is None:
            raise UnsupportedError("GhostClippingEngine: modules with several rows per example need "
                                   "recording(batch_size=...).")
        return t.reshape(self._batch_size, -1, *t.shape[1:])

    def has_gradients(self) -> bool:
        return bool(self._pieces)

    def squared_norms(self, groups: torch.Tensor | None = None) -> dict[nn.Parameter, torch.Tensor]:
        """Per-example squared gradient norm of every trained tensor that got a gradient, float32 (B,). With
        `groups` (each row's group in 0..G-1, e.g. its unit of privacy): the squared norm of each group's SUMMED
        gradient ||Σ_{rows r of g} G_r||², (G,); the clipped sums stay per row (`each_clipped_sum` with each row
        given its group's factor is exact)."""
        norms, grams, regroup = {}, {}, _Regroup(groups)
        for p, pieces in self._pieces.items():
            factored = [x for x in pieces if x[0] == "factors"]
            explicit = [x[1].reshape(len(x[1]), -1) for x in pieces if x[0] == "explicit"]
            if factored and explicit:  # a tensor with uses of both kinds: one per-example gradient
                explicit = explicit + [_materialise(left, right) for _, left, right in factored]
                factored = []
            if explicit:
                total = sum(explicit)
                pieces[:] = [("explicit", total)]
                self.explicit.add(p)
                norms[p] = regroup.sum(total).pow(2).sum(1)
                continue
            if groups is not None and any(isinstance(right, OneHot) for _, _, right in factored):
                raise UnsupportedError("GhostClippingEngine: grouped norms need a dense right factor (its zero padding "
                                       "cancels the padded tokens).")
            factored = [(kind, regroup(left), regroup(right)) for kind, left, right in factored]
            if groups is not None and all(_materialise_now(left, right) for _, left, right in factored):
                # a group's T is m·T: its gradient (G, p·q) is then smaller than its Grams (G, (m·T)²); formed for
                # the norm only (the clipped sums stay book-kept per row)
                norms[p] = sum(_materialise(left, right) for _, left, right in factored).pow(2).sum(1)
                continue
            norm = 0
            for u, (_, lu, ru) in enumerate(factored):  # Σ over pairs of uses, cross terms twice
                for v in range(u, len(factored)):
                    _, lv, rv = factored[v]
                    term = _batched_dot(self._cached_gram(lu, lv, grams), self._cached_gram(ru, rv, grams))
                    norm = norm + (term if u == v else 2 * term)
            norms[p] = norm
        return norms

    @staticmethod
    def _cached_gram(x, y, cache: dict) -> torch.Tensor:
        """Gram of a factor with itself computed once per input tensor (q, k, v projections share theirs)."""
        if x is not y or isinstance(x, OneHot):
            return _gram(x, y)
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype)
        if key not in cache:
            cache[key] = _gram(x, x)
        return cache[key]

    def clipped_sums(self, factors: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Σ_i factors[p]_i · G_i(p) for every tensor of `squared_norms()`, in float32 and p's shape."""
        return dict(self.each_clipped_sum(factors))

    def each_clipped_sum(self, factors: dict[nn.Parameter, torch.Tensor]):
        """The clipped sums one tensor at a time, as (p, sum), in the order of `factors` (the same on every rank),
        each formed when asked for and its pieces freed: a caller that folds each away (a sharded run
        reduce-scatters it) never holds more than one full-size sum."""
        unknown = [p for p in self._pieces if p not in factors]
        if unknown:
            raise ArgumentError(f"GhostClippingEngine: no clip factors for {len(unknown)} tensor(s) with a gradient.")
        for p in [p for p in factors if p in self._pieces]:
            pieces = self._pieces.pop(p)
            c = at_least_f32(factors[p])
            # no zeros to start from, and one-hot uses (an embedding's) last: they add their rows into the sum
            pieces.sort(key=lambda piece: piece[0] == "factors" and isinstance(piece[1], OneHot))
            total = None
            for kind, *data in pieces:
                if kind == "explicit":
                    total = _add_into(total, c @ data[0].reshape(len(c), -1))
                else:
                    total = _weighted_sum(c, *data, into=total)
            del pieces
            yield p, total.view(p.shape)
        self.clear()
