"""Frozen prefixes cost nothing: the hidden states entering the first trained block, computed once.

With `trainable_blocks=k` (or any `trainable_groups` whose lowest trained block is L-k, e.g. "last:k,final,head"),
blocks 0..L-k-1 and the embeddings below them are frozen. They run in eval mode (`set_frozen_prefix_modes`, cached
or not: they are not trained, so their dropout would only make the features random), so the hidden states entering
block L-k are a deterministic function of one example. We compute them once
per dataset (one pass, eval mode, no autograd, stopped at block L-k) and every step then runs the model with its
block list cut to the trained blocks, the cached states injected as the first trained block's input
(`run_from_states`). The embeddings, the attention mask (padding, causal) and the position embeddings (rotary
cos/sin) are still built by the model's own forward from the batch, as without the cache: one embedding lookup or
patch projection, no per-model code. So a step costs k blocks + final norm + head instead of L blocks.

The DP mechanism is unchanged: the same Poisson batches index the same n examples, each example's gradient is
clipped and noised as before; the cached states are a function of that one example alone.

Used only when it gives the same updates (else the uncached path, with the reason logged):
- no parameter used below block L-k trains in any phase (GPT-2's `lm_head` tied to `wte` does: refused);
- the dataset is a `datasets.Dataset` with no transform (random augmentation), unless forced;
- rows have a fixed length (a collator padding each batch to its longest row changes the states' shape);
- on the first batch, the cut model's logits equal the full model's (checked);
- the states fit `cache_features_max_memory_gb` (in memory) or `cache_features_max_disk_gb` (a numpy memmap in a
  fresh temporary folder, never the output_dir, deleted at exit; disk is off by default).

The cache holds features of private data: it lives in this process (and that temporary folder) only, is no module
buffer (so in no state_dict, checkpoint or push), and is reused for evaluation and across `train()` calls of the
same process, keyed by (frozen weights, dataset, cut point), so a sweep pays the feature pass once.
`feature_store.clear_feature_cache()` frees it.

Example:
    >>> import torch
    >>> from hf_dp_repr.scope.prefix_cache import run_from_states
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> model = tiny_vit().eval()
    >>> x = torch.randn(2, 1, 8, 8)
    >>> states = {}
    >>> h = model.vit.layers[3].register_forward_pre_hook(lambda m, a: states.setdefault("in", a[0]))
    >>> full = model(pixel_values=x).logits; h.remove()
    >>> with run_from_states(model, "vit.layers", 3, states["in"]):
    ...     cut = model(pixel_values=x).logits
    >>> torch.allclose(full, cut, atol=1e-6)
    True
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ..errors import DPConfigError, ScopeError, UnsupportedError
from .blocks import find_block_stack, head_modules, modules_after
from .feature_store import (
    CacheEntry,
    NotCacheable,
    data_reason_not_to_cache,
    dataset_key,
    lookup,
    store,
    weights_digest,
)

STATES_KEY = "_dp_prefix_states"  # the batch key of the cached states; popped before the model sees the batch


@dataclass
class CutPoint:
    """Where the frozen prefix ends: block `first` of the stack `stack_name` is the first trained block."""

    stack_name: str
    first: int


class StatesDataset(Dataset):
    """The training examples as before, each with its cached prefix states."""

    def __init__(self, dataset, states: torch.Tensor):
        self.dataset, self.states = dataset, states

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {**self.dataset[i], STATES_KEY: torch.as_tensor(self.states[i])}


class StatesCollator:
    """The usual collator for the examples, the cached states stacked beside them."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, items: list[dict]) -> dict:
        states = torch.stack([item[STATES_KEY] for item in items])
        batch = self.collator([{k: v for k, v in item.items() if k != STATES_KEY} for item in items])
        batch[STATES_KEY] = states
        return batch


# ---- where the prefix ends, and whether it may be cached ------------------------------------------------------
def cut_point(model: nn.Module, scopes: list, block_stack: str | None = None) -> CutPoint | None:
    """The lowest block holding a parameter the last phase trains (block L-k of `trainable_blocks=k`), when
    nothing below it trains but the head's own tensors (a head tied to the input embeddings): the frozen prefix
    ends there. None for a linear probe, full fine-tuning, or a scope reaching into the embeddings."""
    scope = scopes[-1] if scopes else None
    if scope is None or scope.head_only or not scope.frozen_prefix:
        return None
    try:
        name, stack = find_block_stack(model, block_stack)
    except ScopeError:
        return None
    trained = {id(p) for p in scope.parameters}
    first = next((i for i, block in enumerate(stack) if any(id(p) in trained for p in block.parameters())), None)
    if first is None:
        return None
    head = {id(p) for _, m in head_modules(model) for p in m.parameters()}
    below = [n for n, p in _prefix_parameters(model, name, first) if id(p) in trained and id(p) not in head]
    return None if below else CutPoint(name, first)


def structural_reason_not_to_cache(model: nn.Module, cut: CutPoint, scopes: list) -> str | None:
    """Why the prefix below `cut` is not frozen in every phase (None if it is)."""
    trained = {id(p) for scope in scopes for p in scope.parameters}
    shared = [n for n, p in _prefix_parameters(model, cut.stack_name, cut.first) if id(p) in trained]
    if shared:
        return (f"parameters below block {cut.first} train ({', '.join(shared)}; e.g. an input embedding tied to the "
                "LM head): the prefix changes at every step")
    return None


def _prefix_parameters(model: nn.Module, stack_name: str, first: int) -> list[tuple[str, nn.Parameter]]:
    """Parameters (by every name they have) of everything but the trained blocks, the modules after the stack
    and the head: the frozen prefix."""
    stack = model.get_submodule(stack_name)
    top = [f"{stack_name}.{i}." for i in range(first, len(stack))]
    top += [f"{n}." for n, _ in modules_after(model, stack_name)]
    base = getattr(model, "base_model", model)
    top += [f"{n}." for n, child in model.named_children() if child is not base]
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if not n.startswith(tuple(top))]


def set_frozen_prefix_modes(model: nn.Module, cut: CutPoint) -> None:
    """The frozen prefix (modules registered before the block stack at each level of its path: embeddings, their
    dropout; and the frozen blocks) in eval mode; any module holding a trained parameter stays in train mode
    (Opacus computes per-example gradients only there)."""
    parent, path = model, cut.stack_name.split(".")
    for part in path:
        names = [n for n, _ in parent.named_children()]
        for n in names[:names.index(part)]:
            parent.get_submodule(n).eval()
        parent = parent.get_submodule(part)
    for block in list(parent)[:cut.first]:
        block.eval()
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            module.train()


# ---- running from cached states --------------------------------------------------------------------------------
class _StopForward(Exception):
    pass


@contextmanager
def run_from_states(model: nn.Module, stack_name: str, first: int, states: torch.Tensor):
    """Inside, `model(**batch)` skips blocks 0..first-1 and feeds `states` to block `first` instead of the
    embeddings' output (whose shape must match). The block list is cut only inside (never saved that way)."""
    parent_name, _, attr = stack_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    stack = parent._modules[attr]

    def inject(_module, args, kwargs):
        given = args[0] if args else kwargs["hidden_states"]
        if given.shape != states.shape:
            raise UnsupportedError(f"DPTrainer: cached prefix states of shape {tuple(states.shape)} for a batch "
                                   f"whose hidden states are {tuple(given.shape)}: rows must keep a fixed length (pad "
                                   "to max_length), or set cache_features=False.")
        new = states.to(device=given.device, dtype=given.dtype)
        return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})

    handle = stack[first].register_forward_pre_hook(inject, with_kwargs=True)
    parent._modules[attr] = type(stack)(list(stack)[first:])
    try:
        yield
    finally:
        parent._modules[attr] = stack
        handle.remove()


def compute_prefix_states(model: nn.Module, cut: CutPoint, loader: DataLoader, device, max_memory_gb: float,
                          max_disk_gb: float, show_progress: bool = True) -> "CacheEntry":
    """One pass over `loader` in eval mode, stopped at block `cut.first`: the states entering it, per example.

    Raises `NotCacheable` when they do not reproduce the model's logits, vary in shape, or exceed the bounds."""
    block = model.get_submodule(cut.stack_name)[cut.first]
    seen: dict[str, torch.Tensor] = {}

    def keep(_module, args, kwargs):
        seen["states"] = (args[0] if args else kwargs["hidden_states"]).detach()
        if seen.get("stop"):
            raise _StopForward

    handle = block.register_forward_pre_hook(keep, with_kwargs=True)
    was_training, entry, at = model.training, None, 0
    model.eval()
    # The pass is deterministic; forking the RNG keeps it from shifting the draws of training (dropout in the
    # trained blocks; each DataLoader iteration draws a seed), so cached and uncached runs draw alike.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for batch in tqdm(loader, desc=f"caching the states entering block {cut.first}",
                              disable=not show_progress):
                batch = {k: v.to(device) for k, v in batch.items() if k != "labels"}
                if entry is None:  # first batch: the cut model must give the full model's logits
                    full = model(**batch).logits
                    states = seen["states"]
                    with run_from_states(model, cut.stack_name, cut.first, states):
                        cut_logits = model(**batch).logits
                    seen["states"] = states
                    if not torch.allclose(full, cut_logits, rtol=1e-5, atol=1e-5 * float(full.abs().max())):
                        raise NotCacheable(f"the model's output changes when its blocks below {cut.first} are "
                                           "skipped and their output fed to the block (its forward uses more than "
                                           "the block list)")
                    entry = CacheEntry.allocate(len(loader.dataset), seen["states"].shape[1:], seen["states"].dtype,
                                                max_memory_gb, max_disk_gb)
                    seen["stop"] = True
                else:
                    try:
                        model(**batch)
                    except _StopForward:
                        pass
                states = seen["states"]
                if states.shape[1:] != entry.states.shape[1:]:
                    entry.delete()
                    raise NotCacheable(f"the rows' hidden states change shape between batches "
                                       f"({tuple(entry.states.shape[1:])} then {tuple(states.shape[1:])}): the "
                                       "collator pads each batch to its longest row; pad to max_length to cache")
                entry.states[at:at + len(states)] = states.cpu().numpy() if entry.folder else states.cpu()
                at += len(states)
    finally:
        handle.remove()
        model.train(was_training)
    return entry


def cache_key(model: nn.Module, cut: CutPoint, dataset, collator) -> tuple:
    """(model class, cut, hash of the frozen prefix's weights and buffers, dataset, collator)."""
    frozen = _prefix_parameters(model, cut.stack_name, cut.first) + list(model.named_buffers())
    return (type(model).__name__, cut.stack_name, cut.first, weights_digest(frozen), *dataset_key(dataset, collator))


def states_for(model: nn.Module, cut: CutPoint, dataset, collator, args) -> CacheEntry:
    """The cached states of `dataset` (computed now unless this process already has them)."""
    key = cache_key(model, cut, dataset, collator)
    if (entry := lookup(key)) is not None:
        return entry
    if len(dataset) > 1 and (reason := _varying_length_reason(dataset, collator)):
        raise NotCacheable(reason)
    loader = DataLoader(dataset, batch_size=args.per_device_eval_batch_size, collate_fn=collator)
    entry = compute_prefix_states(model, cut, loader, args.device, args.cache_features_max_memory_gb,
                                  args.cache_features_max_disk_gb, show_progress=not args.disable_tqdm)
    store(key, entry)
    return entry


def _varying_length_reason(dataset, collator) -> str | None:
    """Why a row's collated shape may depend on its batch (None if it does not): a collator padding each batch to
    its longest row gives the same example different hidden-state shapes."""
    together = collator([dataset[i] for i in range(min(len(dataset), 64))])
    for i in range(min(len(dataset), 8)):
        for key, value in collator([dataset[i]]).items():
            if torch.is_tensor(value) and value.shape[1:] != together[key].shape[1:]:
                return (f"the collator pads each batch to its longest row (`{key}`: {tuple(value.shape[1:])} alone, "
                        f"{tuple(together[key].shape[1:])} in a batch); pad to a fixed max_length to cache")
    return None


def prepare_prefix_cache(model: nn.Module, scopes: list, args, train_dataset, dataset_and_collator
                         ) -> tuple[CutPoint | None, CacheEntry | None, str | None]:
    """(cut, the training set's cached states, None) when this run may train on them (`args.cache_features`:
    None = when safe, True = always, False = never); else (cut or None, None, why not) where "why not" is None
    when there is no frozen prefix to cache."""
    cut = cut_point(model, scopes, args.block_stack)
    if cut is None or cut.first == 0 or args.cache_features is False or train_dataset is None:
        return cut, None, None
    forced = bool(args.cache_features)
    reason = structural_reason_not_to_cache(model, cut, scopes)
    if reason is None and not forced:
        reason = data_reason_not_to_cache(train_dataset)
    if reason is None:
        dataset, collator = dataset_and_collator()
        try:
            return cut, states_for(model, cut, dataset, collator, args), None
        except NotCacheable as e:
            reason = str(e)
    if forced:
        raise DPConfigError(f"DPTrainer: cache_features=True, but {reason}.")
    return cut, None, reason
