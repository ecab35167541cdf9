"""Which rows of a hooked module's input belong to which example: checked at the start of training and on every
micro-batch.

Both clipping engines read the input and the output gradient of every module that owns a trained tensor with the
example first. A module fed anything else would get the "per-example" gradients of something else: T5's relative
position bias is an Embedding fed (q, k) bucket ids that no example owns, and a sequence-first attention
(`nn.MultiheadAttention(batch_first=False)`, kept by `ModuleValidator.fix`) feeds its projections (T, B, d). With
B = T nothing crashes, and one example could move the clipped sum by more than 2C. So:

- `RowsProbe` (used by `privacy.row_probe` at the start of training) records the rows of every hooked module on k
  and on k + 1 rows of the same examples (the same padded length), the last row a copy of the first, and
  `rows_per_example` accepts a module whose input and output have k and k + 1 rows, or r·k and r·(k + 1) with the
  rows example-major (OPT's MLP and its LayerNorm see (B·T, d)); in both cases the copy's rows must equal those of
  the first example. Anything else is refused before training, naming the module;
- `ExampleRows` checks every hooked module on every micro-batch: B rows, or a multiple of B for the modules the
  probe found example-major. A size check alone cannot tell (T, B, d) from (B, T, d) when B = T; the probe can.

    >>> import torch
    >>> layer = torch.nn.Linear(4, 2)
    >>> rows = ExampleRows(layer)
    >>> with rows.expect(3):
    ...     _ = layer(torch.randn(3, 5, 4))
    >>> with rows.expect(3):
    ...     _ = layer(torch.randn(5, 3, 4))
    Traceback (most recent call last):
    hf_dp_repr.errors.NotPrivatizableError: <root> (Linear) trains parameters but its input has shape (5, 3, 4) ...
    >>> rows.remove()
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..errors import NotPrivatizableError
from .sharding import base_type

# The modules whose per-example rules (both engines) may sum several rows per example.
SEVERAL_ROWS = (nn.Linear, Conv1D, nn.Embedding, nn.LayerNorm)
FIX = ("Both clipping engines take the first dimension of a trained module's input and output as the example. "
       "Fix: freeze that module (`requires_grad_(False)`: e.g. T5's `relative_attention_bias`, whose bucket ids "
       "are shared by all examples), or feed it example-first inputs (e.g. build `nn.MultiheadAttention("
       "batch_first=True)` before `ModuleValidator.fix`).")


def hooked_modules(model: nn.Module) -> dict[nn.Module, str]:
    """The modules that own a trained tensor (those both engines hook), with their paths."""
    return {m: name or "<root>" for name, m in model.named_modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))}


def first_tensor(value) -> torch.Tensor | None:
    """The first tensor of a module's inputs or output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return next((t for t in map(first_tensor, items) if t is not None), None)


def close_enough(dtype: torch.dtype, device: torch.device) -> float:
    """Relative tolerance between two computations of one example's values with other rows around them: kernels
    may round differently (half precision; TF32 convolutions or other algorithms on an accelerator)."""
    if not dtype.is_floating_point:
        return 0.0
    if torch.finfo(dtype).bits <= 16:
        return 8 * torch.finfo(dtype).eps
    return 1e-5 if device.type == "cpu" else 1e-3


def _error(name: str, module: nn.Module, detail: str) -> NotPrivatizableError:
    return NotPrivatizableError(f"{name} ({type(module).__name__}) trains parameters but {detail}. {FIX}")


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"


class ExampleRows:
    """Forward hooks on `model`'s hooked modules; inside `expect(n)`, each input and output must have n rows, or
    a multiple of n for the modules `several` names (example-major, found by the probe). With `opacus=True` such a
    module's `max_batch_len` is set to n, so Opacus' rules (`grad_samplers.examples_first`) sum its rows per example.
    """

    def __init__(self, model: nn.Module, several=(), opacus: bool = False):
        self.names = hooked_modules(model)
        self.several = {m for m, name in self.names.items() if name in set(several)}
        self.opacus = opacus
        self.n: int | None = None
        self._handles = [m.register_forward_hook(self._check, with_kwargs=True) for m in self.names]

    @contextlib.contextmanager
    def expect(self, n: int):
        self.n = n
        try:
            yield self
        finally:
            self.n = None

    def _check(self, module, args, kwargs, output):
        if self.n is None:
            return
        for what, t in (("input", first_tensor((args, kwargs))), ("output", first_tensor(output))):
            rows = t.shape[0] if t is not None and t.dim() else None
            if t is None or rows == self.n or (module in self.several and rows and rows % self.n == 0):
                continue
            raise _error(self.names[module], module, f"its {what} has shape {_shape(t)} in a micro-batch of "
                                                     f"{self.n} examples")
        if self.opacus and module in self.several:
            module.max_batch_len = self.n

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class RowsProbe:
    """Records, for one forward of `n` rows, each hooked module call's input and output shapes and, when the last
    row is a copy of the first (`copy=True`), whether the copy's rows equal the first example's (example-major)."""

    def __init__(self, model: nn.Module, n: int, copy: bool):
        self.names, self.n, self.copy = hooked_modules(model), n, copy
        self.calls: dict[nn.Module, list] = {}
        self._handles = []

    def __enter__(self):
        self._handles = [m.register_forward_hook(self._record, with_kwargs=True) for m in self.names]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _record(self, module, args, kwargs, output):
        seen = []
        for t in (first_tensor((args, kwargs)), first_tensor(output)):
            if t is None or not t.dim():
                seen.append(None)
                continue
            same = t.shape[0] % self.n == 0
            if same and self.copy:
                rows = t.detach().reshape(self.n, -1)
                a, b = rows[0].double(), rows[-1].double()
                tol = close_enough(t.dtype, t.device)
                same = bool(torch.allclose(a, b, rtol=tol, atol=tol * float(a.abs().max().clamp(min=1e-3))))
            seen.append((tuple(t.shape), same))
        self.calls.setdefault(module, []).append(seen)


def rows_per_example(first: RowsProbe, second: RowsProbe) -> set[str]:
    """From two probes of k and k + 1 rows: the paths of the modules that see several rows per example
    (example-major); raises `NotPrivatizableError` naming a module whose rows do not follow the examples."""
    several = set()
    for module, name in first.names.items():
        calls_a, calls_b = first.calls.get(module, []), second.calls.get(module, [])
        if len(calls_a) != len(calls_b):
            raise _error(name, module, f"runs {len(calls_a)} times for {first.n} examples and {len(calls_b)} times "
                                       f"for {second.n}")
        for call_a, call_b in zip(calls_a, calls_b):
            for what, a, b in zip(("input", "output"), call_a, call_b):
                if a is None or b is None:
                    continue
                (shape_a, _), (shape_b, same) = a, b
                r = shape_a[0] // first.n
                if shape_a[0] != r * first.n or shape_b[0] != r * second.n or r == 0:
                    raise _error(name, module, f"its {what} has shape {shape_a} for {first.n} examples and "
                                               f"{shape_b} for {second.n} (the same examples padded alike): its first "
                                               "dimension does not follow the examples")
                if not same:
                    raise _error(name, module, f"the rows of two copies of one example differ in its {what} "
                                               f"{shape_b}: its first dimension is not the example")
                if r > 1:
                    if base_type(module) not in SEVERAL_ROWS:
                        raise _error(name, module, f"its {what} has {r} rows per example ({shape_b}), which only the "
                                                   "rules of Linear, Conv1D, Embedding and LayerNorm sum")
                    several.add(name)
    return several
