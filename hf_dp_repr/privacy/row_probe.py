"""The start-of-training probe: on the first (at most 3) training examples, before any step, check what DP-SGD's
per-example clipping takes for granted, and refuse, naming the culprit, what it cannot clip exactly.

- one row per example (no packing: `validation.check_one_row_per_example`, run by the collator wrapper);
- the collator keeps examples apart: replacing one example (by another, and by a stand-in that differs from it
  at every position: its integers moved to other values the examples hold, its floats by 1) leaves every other
  row of the collated batch as it was (a collator that mixes rows, e.g. row i = mean of examples i and i + 1,
  would let one example move every other example's clipped gradient). A collator that draws random numbers (MLM
  masking) is not checked: its rows change from one call to the next anyway;
- each example's loss depends on its own row only: the model's per-example losses on the rows reordered, with a
  copy of the first appended, equal those on the rows as collated;
- the rows of every hooked module follow the examples (`batch_rows.rows_per_example`), on the same two forwards;
- no trained tensor is used outside a call of a module that owns it (`h @ E.T` in a model's forward): neither
  engine sees such a use (they read modules' inputs and output gradients), so its gradient would be wrong.

The forwards run in the modes of a training forward (`DPTrainer.set_training_modes`: train mode, a frozen
backbone or prefix in eval mode), since a layer may mix examples only in training (batch statistics there, a fixed
buffer in eval); dropout is switched off for them (`DropoutOff`: its draws would differ between the passes, and a
mask drawn per element keeps rows apart anyway), and the buffers a training forward may update are put back. Other
random draws of a training forward (stochastic depth: `drop_path_rate > 0`) look like mixing to this check: switch
them off. When an example's loss moves, the module whose output rows first stop following the examples is named.

Cost: two forwards of the model on 2 and 3 rows, a text batch cut to a few tokens (`probe_batch`: the fewest rows
and tokens that still prove these checks), and a few collations; two more forwards only to name the module that mixes
when it refuses. The probe's batches and seeded collations serve these checks only (the global generators are
restored after each collation).

    >>> import torch
    >>> from transformers import default_data_collator
    >>> from hf_dp_repr.privacy.sampler import ExampleBatchCollator
    >>> examples = [{"x": torch.tensor([float(i)]), "labels": i} for i in range(3)]
    >>> check_collator_keeps_examples_apart(ExampleBatchCollator(default_data_collator), examples)["x"].flatten()
    tensor([0., 1., 2.])
    >>> def neighbours(features):  # row i = mean of examples i and i + 1
    ...     batch = default_data_collator(features)
    ...     return {**batch, "x": (batch["x"] + batch["x"].roll(-1, 0)) / 2}
    >>> check_collator_keeps_examples_apart(ExampleBatchCollator(neighbours), examples)
    Traceback (most recent call last):
    hf_dp_repr.errors.DPConfigError: DPTrainer: the data collator mixes examples: replacing example 0 ...
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..errors import DPConfigError, NotPrivatizableError
from .batch_rows import RowsProbe, close_enough, first_tensor, hooked_modules, rows_per_example
from .grad_samplers import batch_position_ids
from .probe_batch import PROBE_EXAMPLES, probe_order, shortened
from .sampler import UNIT_KEY


def _collate_seeded(collate, examples: list, seed: int) -> dict:
    """One collation with torch's, numpy's and Python's global generators seeded (and restored after)."""
    py, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
            return collate(examples)
    finally:
        random.setstate(py)
        np.random.set_state(np_state)


def _rows(batch: dict, i: int) -> dict:
    return {k: v[i] for k, v in batch.items() if isinstance(v, torch.Tensor)}


def _same(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(x[k].shape == y[k].shape and torch.equal(x[k], y[k]) for k in x)


def _other_values(value, column: list):
    """`value` changed at every position, same shape and type: integers to the next value `column` (the same key in
    every probe example) holds, so still valid ids, labels or mask values; floats by + 1; anything else as it is."""
    try:
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if array.dtype.kind == "f":
            changed = array + 1
        elif array.dtype.kind in "iu":
            pool = np.unique(np.concatenate([np.asarray(c.cpu() if isinstance(c, torch.Tensor) else c).ravel()
                                             for c in column if c is not None]))
            if len(pool) < 2:
                return value
            changed = pool[(np.searchsorted(pool, array) + 1) % len(pool)].astype(array.dtype)
        else:
            return value
    except (ValueError, TypeError):  # ragged or mixed values: kept
        return value
    if isinstance(value, torch.Tensor):
        return torch.as_tensor(changed, dtype=value.dtype)
    return changed if isinstance(value, np.ndarray) else changed.tolist()


def _differing(example, examples: list):
    """A stand-in for `example` that differs from it wherever its numbers can (`_other_values`): a collator that
    copies any part of one row into the others (the first tokens, which real examples may share) moves them."""
    if not isinstance(example, dict):
        return None
    return {key: _other_values(value, [e.get(key) for e in examples if isinstance(e, dict)])
            for key, value in example.items()}


def _replaced_moves(collate, examples: list, pos: int, stand_in, batch: dict, shapes: dict) -> list[int] | None:
    """The other rows that change when example `pos` is replaced by `stand_in` (None: the padded shapes changed, so
    rows cannot be compared)."""
    replaced = _collate_seeded(collate, examples[:pos] + [stand_in] + examples[pos + 1:], 0)
    if {key: v.shape for key, v in replaced.items() if isinstance(v, torch.Tensor)} != shapes:
        return None
    return [i for i in range(len(examples)) if i != pos and not _same(_rows(batch, i), _rows(replaced, i))]


def check_collator_keeps_examples_apart(collate, examples: list) -> dict:
    """Collate `examples`; for each position, replace its example by another one that keeps the batch's shapes, and
    by a stand-in that differs from it everywhere (`_differing`), and check that no other row changes. Returns the
    batch as collated (seed 0)."""
    batch = _collate_seeded(collate, examples, 0)
    k = len(examples)
    if k < 2 or not _same(batch, _collate_seeded(collate, examples, 1)):
        return batch  # one example, or a collator that draws random numbers
    shapes = {key: v.shape for key, v in batch.items() if isinstance(v, torch.Tensor)}
    for pos in range(k):
        moved = None
        for other in (j for j in range(k) if j != pos):
            moved = _replaced_moves(collate, examples, pos, examples[other], batch, shapes)
            if moved is not None:
                break  # (None: the replacement changed the padded length: try another)
        stand_in = _differing(examples[pos], examples)
        if not moved and stand_in is not None:
            try:
                moved = _replaced_moves(collate, examples, pos, stand_in, batch, shapes)
            except (ValueError, TypeError, IndexError, KeyError, RuntimeError):
                moved = None  # a collator that cannot take the stand-in: the real examples were checked
        if moved:
            raise DPConfigError(
                f"DPTrainer: the data collator mixes examples: replacing example {pos} of a batch of {k} changed "
                f"row(s) {moved} too, so one example would move other examples' clipped gradients (by more than "
                "C in all; a collator that reorders rows is refused too: rows must stay in the examples' order). "
                "DP-SGD clips each row as one example. Fix: a collator whose row i is built from example i alone "
                "(e.g. DataCollatorWithPadding, default_data_collator); mix inside an example (in the dataset's "
                "map) instead.")
    return batch


class ParameterUses(TorchFunctionMode):
    """Records the trained tensors that an operation uses (with a gradient-carrying result) while none of the
    modules owning them is running: `outside` maps the parameter's name to the operation's name."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.names = {p: name for name, p in model.named_parameters() if p.requires_grad}
        self.owners: dict[nn.Parameter, list[nn.Module]] = {}
        self.slots = []
        for m in hooked_modules(model):
            for attr, p in m.named_parameters(recurse=False):
                self.owners.setdefault(p, []).append(m)
                self.slots.append((m, attr, p))
        # what each module holds now → the parameter it stands for (FSDP2 puts gathered copies on the modules)
        self.live: dict[torch.Tensor, nn.Parameter] = {}
        self.running: dict[nn.Module, int] = {}
        self.outside: dict[str, str] = {}
        self._handles = []

    def __enter__(self):
        for m in {m for ms in self.owners.values() for m in ms}:
            self._handles.append(m.register_forward_pre_hook(lambda m, a: self._enter(m, 1)))
            self._handles.append(m.register_forward_hook(lambda m, a, o: self._enter(m, -1), always_call=True))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return super().__exit__(*exc)

    def _enter(self, module, step):
        self.running[module] = self.running.get(module, 0) + step
        self.live = {getattr(m, attr): p for m, attr, p in self.slots}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs))[0]:
            p = self.live.get(t, t) if isinstance(t, nn.Parameter) else None
            if (p in self.owners and not any(self.running.get(m) for m in self.owners[p])
                    and any(isinstance(o, torch.Tensor) and o.requires_grad for o in tree_flatten(out)[0])):
                self.outside.setdefault(self.names[p], _op_name(func))
        return out


DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
            torch.dropout, torch.dropout_, torch.alpha_dropout, torch.alpha_dropout_, torch.feature_dropout,
            torch.feature_dropout_, torch.feature_alpha_dropout, torch.feature_alpha_dropout_}


class DropoutOff(TorchFunctionMode):
    """Dropout as in eval mode (the input as it is), attention without dropout, the rest of the forward as in
    training: what the probe's two passes run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


class RowPrints:
    """For one forward of `n` rows: each module call's output (its first tensor, example-major) reduced to a few
    numbers per row, in the order the calls end (a module ends before its parent)."""

    def __init__(self, model: nn.Module, n: int):
        self.names = {m: name or "<root>" for name, m in model.named_modules()}
        self.n, self.prints, self._handles = n, [], []

    def __enter__(self):
        self._handles = [m.register_forward_hook(self._record) for m in self.names]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _record(self, module, args, output):
        t = first_tensor(output)
        if t is None or not t.is_floating_point() or not t.dim() or t.shape[0] % self.n or not t.numel():
            self.prints.append((module, None))
            return
        rows = t.detach().reshape(self.n, -1).double()
        ramp = torch.linspace(1, 2, rows.shape[1], dtype=rows.dtype, device=rows.device)
        self.prints.append((module, torch.stack([rows.sum(1), (rows * rows).sum(1), (rows * ramp).sum(1)], 1)))


def first_mixing_module(first: RowPrints, second: RowPrints, order: list[int], tol: float) -> str | None:
    """The first module call (in the order calls end) whose output rows on the reordered examples (`second`) are
    not those of `first` reordered: 'path (Type)', or None when the two passes cannot be matched call by call."""
    if [m for m, _ in first.prints] != [m for m, _ in second.prints]:
        return None
    for (module, a), (_, b) in zip(first.prints, second.prints):
        if a is None or b is None:
            continue
        a = a[order]
        if not torch.allclose(b, a, rtol=tol, atol=tol * float(a.abs().max().clamp(min=1e-3))):
            return f"{first.names[module]} ({type(module).__name__})"
    return None


def _op_name(func) -> str:
    """`torch.matmul`, `Tensor.T` (a property's getter), ..."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and hasattr(owner, "__name__"):
        return f"Tensor.{owner.__name__}"
    return getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))


def probe_training_rows(trainer, dataset, collate, scope=None) -> set[str]:
    """Run the checks above with `trainer` (a DPTrainer: its model, input preparation and `per_example_loss`) on the
    first examples of `dataset`, collated by `collate` (an ExampleBatchCollator), with the tensors of `scope` (the
    run's widest phase, if any) trained. Returns the paths of the hooked modules that see several rows per example
    (for the engines); raises DPConfigError / NotPrivatizableError."""
    examples = [dataset[i] for i in range(min(PROBE_EXAMPLES, len(dataset)))]
    whole = check_collator_keeps_examples_apart(collate, examples)
    k = len(examples)
    order = probe_order(k)
    model = trainer.model
    modes, trained = {m: m.training for m in model.modules()}, {p: p.requires_grad for p in model.parameters()}
    buffers = {b: b.detach().clone() for b in model.buffers()}  # a training forward may update some (counters ...)
    if scope is not None:
        scope.apply(model)
    set_modes = getattr(trainer, "set_training_modes", None)
    set_modes(scope) if set_modes is not None else model.train()
    try:
        batch, seen = shortened(whole), None
        if batch is not whole:  # the cut batch; the whole one if the model refuses it
            try:
                seen = _two_passes(trainer, batch, order)
            except Exception:  # noqa: BLE001 - a forward that needs the whole length: probed on it below
                seen = None
            if seen is not None and seen[3] is not None and not torch.isfinite(seen[3]).all():
                seen = None
            if seen is None:
                batch = whole
                _put_back(buffers)
        first, second, uses, losses, losses_again = seen or _two_passes(trainer, batch, order)
        mixes = losses is not None and not _close(losses_again, losses[order], model)
        culprit = _first_mixing_module(trainer, batch, order) if mixes and not uses.outside else None
    finally:
        for m, flag in modes.items():
            m.training = flag
        for p, flag in trained.items():
            p.requires_grad_(flag)
        _put_back(buffers)
    if uses.outside:
        listed = ", ".join(f"{name} (by {op})" for name, op in uses.outside.items())
        raise NotPrivatizableError(
            f"DPTrainer: trained parameters are used outside a call of the module that owns them: {listed}. Both "
            "clipping engines form per-example gradients from module calls, so such a use would be missing from the "
            "clipped gradient. Fix: use them through a module (e.g. an nn.Linear head whose weight is the embedding: "
            "`head.weight = embedding.weight; head(h)`), or freeze them (`requires_grad_(False)`).")
    several = rows_per_example(first, second)
    if mixes:
        where = (f"the first module whose output rows stop following the examples is {culprit}" if culprit else
                 "no module's output rows were seen to mix: `per_example_loss` may")
        raise NotPrivatizableError(
            "DPTrainer: an example's loss changes when the other rows of its micro-batch change (the model's "
            f"per-example losses on rows {order} are not those on rows {list(range(k))} reordered, in training mode "
            f"with dropout off): {where}. The model or `per_example_loss` mixes examples (batch statistics, a "
            "batch-wide normalisation ..., or random draws other than dropout, such as stochastic depth), so one "
            "example would move other examples' clipped gradients. Fix: compute each example's loss from its own "
            "row only (e.g. per-example or running statistics), or switch the random draws off.")
    return several


def _again(batch: dict, order: list[int]) -> dict:
    return {key: v[order] if isinstance(v, torch.Tensor) else v for key, v in batch.items()}


def _two_passes(trainer, batch: dict, order: list[int]) -> tuple:
    """The probe's two forwards: on `batch` (with gradients, for `ParameterUses`), then on its rows in `order` (the
    last a copy of the first). Returns (RowsProbe, RowsProbe, ParameterUses, losses, losses on the rows in order)."""
    model, k = trainer.model, len(order) - 1
    first, second, uses = RowsProbe(model, k, copy=False), RowsProbe(model, k + 1, copy=True), ParameterUses(model)
    with first, uses, DropoutOff():
        losses = _losses(trainer, batch)
    with second, torch.no_grad(), DropoutOff():
        losses_again = _losses(trainer, _again(batch, order))
    return first, second, uses, losses, losses_again


def _first_mixing_module(trainer, batch: dict, order: list[int]) -> str | None:
    """The two passes again, without gradients, recording every module's output rows: the module that mixes."""
    model, k = trainer.model, len(order) - 1
    prints, prints_again = RowPrints(model, k), RowPrints(model, k + 1)
    with prints, torch.no_grad(), DropoutOff():
        _losses(trainer, batch)
    with prints_again, torch.no_grad(), DropoutOff():
        _losses(trainer, _again(batch, order))
    return first_mixing_module(prints, prints_again, order, _tolerance(model))


def _put_back(buffers: dict) -> None:
    with torch.no_grad():
        for b, value in buffers.items():
            b.copy_(value)


def _tolerance(model: nn.Module) -> float:
    """The rounding of the model's dtype and device (`batch_rows.close_enough`)."""
    weight = next((p for p in model.parameters() if p.is_floating_point()), torch.zeros(()))
    return close_enough(weight.dtype, weight.device)


def _close(x: torch.Tensor, y: torch.Tensor, model: nn.Module) -> bool:
    tol = _tolerance(model)
    return torch.allclose(x.double(), y.double(), rtol=tol, atol=tol)


def _losses(trainer, batch: dict) -> torch.Tensor | None:
    """Per-example losses as `DPTrainer.training_step` computes them, by its `example_losses` (None without labels
    when the trainer's losses need them: the model runs alone)."""
    inputs = trainer._prepare_inputs({k: v for k, v in batch.items() if k != UNIT_KEY})
    if "labels" not in inputs and getattr(trainer, "batch_has_labels", True):
        batch_position_ids(trainer.model, inputs)
        trainer.model(**inputs)
        return None
    return trainer.example_losses(trainer.model, inputs).detach()
