"""Layer selection beyond "the last k blocks": block selectors and named parameter groups, combined as a union.

`trainable_groups` is a list (or a comma-separated string) of selectors; the parameters that train are the union
of what each selects. Nothing else trains: name `head` if the task head should train too. `trainable_blocks=k` is
the short form of `"last:k,final,head"` (and `trainable_blocks=0` of `"head"`, the linear probe): the same
parameters train, with the same frozen-prefix handling and caches (see `scope.blocks` and `scope.prefix_cache`).

Block selectors (indices into the block stack found by `scope.find_block_stack`, 0 = the block next to the
embeddings):
- an integer `i` (negative counts from the end, as in Python): block i;
- `first:k` / `last:k`: the first / last k blocks;
- `every_other`: blocks 0, 2, 4, ...; `every_other:odd`: blocks 1, 3, 5, ...

Named groups (found from the model's structure, not from a table of model names):
- `head`: the modules outside `model.base_model`; `head` alone is the linear probe (the backbone in eval mode,
  the head trained on cached inputs when safe);
- `final`: the modules after the block stack inside the base model (final norm `layernorm`/`ln_f`/`norm`, BERT's
  `pooler`); may be empty (a post-LN encoder without pooler);
- `norms`: every normalisation module anywhere in the model (class name containing "Norm": LayerNorm, RMSNorm, ...);
- `biases`: every parameter named `bias` anywhere (BitFit, Ben Zaken et al. 2022);
- `attention`: in every block, the submodule whose name contains "attn" or "attention" (ViT/BERT `attention`,
  GPT-2 `attn`, Llama `self_attn`), its norms excluded;
- `mlp`: in every block, what is neither attention nor a norm (ViT/BERT `intermediate` + `output.dense`, GPT-2 and
  Llama `mlp`).

Both are registries: a new selector is one `register_block_selector` (a regex and `pick(match, depth, stack_name)
-> block indices`), a new group one `register_group` (`select(model, stack) -> (parameters, description)`):

    >>> from hf_dp_repr.scope.groups import BLOCK_SELECTORS, register_block_selector, select_groups
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> select_groups(tiny_vit(), "first:2,norms,head").description
    'blocks 0, 1 of 4 (vit.layers) + norms + head (classifier)'
    >>> @register_block_selector(r"middle:(\\d+)", example="middle:k")
    ... def middle(match, depth, stack_name):
    ...     k = int(match[1])
    ...     return range((depth - k) // 2, (depth - k) // 2 + k)
    >>> select_groups(tiny_vit(), "middle:2,head").description
    'blocks 1, 2 of 4 (vit.layers) + head (classifier)'
    >>> _ = BLOCK_SELECTORS.pop("middle:k")  # (a doctest leaves the registry as it found it)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from ..errors import ScopeError
from ..registry import Registry
from .blocks import Scope, find_block_stack, head_modules, linear_probe_scope, modules_after, unique_parameters

Stack = tuple[str, nn.ModuleList]  # (dotted name, blocks)


@dataclass(frozen=True)
class BlockSelector:
    pattern: re.Pattern
    example: str
    pick: Callable[[re.Match, int, str], Iterable[int]]


@dataclass(frozen=True)
class Group:
    name: str
    select: Callable[[nn.Module, Stack | None], tuple[list[nn.Parameter], str]]
    needs_stack: bool
    may_be_empty: bool


BLOCK_SELECTORS = Registry("block selector", ScopeError)  # by example, in registration order (errors list them so)
GROUPS = Registry("group", ScopeError)
_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)


def register_block_selector(pattern: str, example: str, *, replace: bool = False):
    """Decorator: `pick(match, depth, stack_name)` gives the block indices (0..depth-1, or negative from the end)
    of a selector that fully matches the regex `pattern`; it raises `ScopeError` naming the selector when it cannot
    apply to `depth` blocks. `example` is how the error message and the README spell it."""
    def register(pick):
        BLOCK_SELECTORS.add(example, BlockSelector(re.compile(pattern), example, pick), replace=replace)
        return pick
    return register


def register_group(name: str, needs_stack: bool = False, may_be_empty: bool = False, *, replace: bool = False):
    """Decorator: `select(model, stack)` gives (parameters, description) of the group `name`; `stack` is the
    (name, ModuleList) of the block stack when `needs_stack`, else None. A group that selects nothing is refused
    (a typo or a model without such parameters) unless `may_be_empty`."""
    def register(select):
        GROUPS.add(name, Group(name, select, needs_stack, may_be_empty), replace=replace)
        return select
    return register


# ---- the built-in block selectors ------------------------------------------------------------------------------
@register_block_selector(r"-?\d+", example="<index>")
def _index(match, depth, stack_name):
    i = int(match[0])
    if not -depth <= i < depth:
        raise ScopeError(f"trainable_groups: block index {i} is out of range: {stack_name} has {depth} blocks, "
                         f"valid indices are 0..{depth - 1} (or -{depth}..-1 from the end).")
    return [i]


def _count(match, depth, stack_name) -> int:
    k = int(match[1])
    if not 1 <= k <= depth:
        raise ScopeError(f"trainable_groups: {match[0]!r} asks for {k} blocks, but {stack_name} has {depth}; "
                         f"use 1..{depth}.")
    return k


@register_block_selector(r"first:(\d+)", example="first:k")
def _first(match, depth, stack_name):
    return range(_count(match, depth, stack_name))


@register_block_selector(r"last:(\d+)", example="last:k")
def _last(match, depth, stack_name):
    return range(depth - _count(match, depth, stack_name), depth)


@register_block_selector(r"every_other", example="every_other")
def _even(match, depth, stack_name):
    return range(0, depth, 2)


@register_block_selector(r"every_other:odd", example="every_other:odd")
def _odd(match, depth, stack_name):
    return range(1, depth, 2)


# ---- the built-in named groups ---------------------------------------------------------------------------------
def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)) or \
        "norm" in type(module).__name__.lower()


def norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)]


@register_group("head")
def _head(model, stack):
    head = head_modules(model)
    if not head:
        raise ScopeError(f"trainable_groups: 'head' selected, but {type(model).__name__} has no head outside "
                         "its base model. Load the model with a task head, or drop 'head'.")
    return [p for _, m in head for p in m.parameters()], f"head ({', '.join(n for n, _ in head)})"


@register_group("final", needs_stack=True, may_be_empty=True)
def _final(model, stack):
    after = [(n, m) for n, m in modules_after(model, stack[0]) if any(True for _ in m.parameters())]
    return [p for _, m in after for p in m.parameters()], f"final ({', '.join(n for n, _ in after)})"


@register_group("norms")
def _norms(model, stack):
    return norm_parameters(model), "norms"


@register_group("biases")
def _biases(model, stack):
    return [p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] == "bias"], "biases"


def attention_module(block: nn.Module, where: str) -> nn.Module:
    """The block's outermost submodule named like attention (`attention`, `attn`, `self_attn`, ...)."""
    for name, module in block.named_modules():
        if name and _ATTENTION_NAME.search(name.rsplit(".", 1)[-1]):
            return module
    children = [n for n, _ in block.named_children()]
    raise ScopeError(f"trainable_groups: no attention submodule found in {where} (its children: {children}); "
                     "the groups 'attention' and 'mlp' need a child named like 'attention' or 'attn'.")


def _block_part(model, stack, attention: bool) -> list[nn.Parameter]:
    """In every block: the attention submodule's parameters (or every other one), norms excluded."""
    stack_name, blocks = stack
    norms = {id(p) for p in norm_parameters(model)}
    chosen = []
    for i, block in enumerate(blocks):
        inside = {id(p) for p in attention_module(block, f"{stack_name}.{i}").parameters()}
        chosen += [p for p in block.parameters() if id(p) not in norms and (id(p) in inside) == attention]
    return chosen


@register_group("attention", needs_stack=True)
def _attention(model, stack):
    return _block_part(model, stack, attention=True), f"attention of every block ({stack[0]})"


@register_group("mlp", needs_stack=True)
def _mlp(model, stack):
    return _block_part(model, stack, attention=False), f"mlp of every block ({stack[0]})"


# ---- parsing and selecting ---------------------------------------------------------------------------------------
def _block_selector(token) -> tuple[BlockSelector, re.Match] | None:
    for selector in BLOCK_SELECTORS.values():
        if (match := selector.pattern.fullmatch(str(token))) is not None:
            return selector, match
    return None


def parse_groups(spec) -> list[str | int]:
    """Selectors of `spec` (a comma-separated string or a list of names and integers), checked for syntax."""
    if not isinstance(spec, (str, list, tuple)):
        raise ScopeError(f"trainable_groups={spec!r}: give a comma-separated string or a list of selectors (e.g. "
                         "'last:2,head').")
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str | int] = []
    for item in items:
        token = item.strip() if isinstance(item, str) else item
        if isinstance(token, str) and re.fullmatch(r"-?\d+", token):
            token = int(token)
        if isinstance(token, bool) or not (isinstance(token, (int, str)) and
                                           (token in GROUPS or _block_selector(token) is not None)):
            raise ScopeError(f"trainable_groups: unknown selector {item!r}. Valid: the groups {', '.join(GROUPS)}"
                             f" and the block selectors {', '.join(BLOCK_SELECTORS)} (e.g. 'first:2,norms,head').")
        out.append(token)
    if not out:
        raise ScopeError("trainable_groups is empty; name at least one group or block (e.g. 'last:2,head').")
    return out


def is_linear_probe(spec) -> bool:
    """Whether `trainable_groups=spec` is the head alone: a linear probe, as `trainable_blocks=0`."""
    return spec is not None and set(parse_groups(spec)) == {"head"}


def block_indices(selectors: list[str | int], depth: int, stack_name: str) -> list[int]:
    """The block indices the block selectors pick, checked against the depth of the stack."""
    picked: set[int] = set()
    for s in selectors:
        selector, match = _block_selector(s)
        picked.update(i % depth for i in selector.pick(match, depth, stack_name))
    return sorted(picked)


def select_groups(model: nn.Module, spec, block_stack: str | None = None) -> Scope:
    """The `Scope` of `trainable_groups=spec`: the union of the selected blocks and named groups (the head alone:
    the linear probe's scope)."""
    selectors = parse_groups(spec)
    names = [s for s in selectors if isinstance(s, str) and s in GROUPS]
    block_selectors = [s for s in selectors if s not in names]
    head = head_modules(model)
    if set(selectors) == {"head"}:
        _head(model, None)  # no head: refused, naming trainable_groups
        return linear_probe_scope(model)
    needs_stack = block_selectors or any(GROUPS[n].needs_stack for n in names)
    stack = find_block_stack(model, block_stack) if needs_stack else None
    params: list[nn.Parameter] = []
    parts: list[str] = []
    if block_selectors:
        indices = block_indices(block_selectors, len(stack[1]), stack[0])
        params += [p for i in indices for p in stack[1][i].parameters()]
        parts.append(f"blocks {', '.join(map(str, indices))} of {len(stack[1])} ({stack[0]})")
    for name in dict.fromkeys(names):
        chosen, description = GROUPS[name].select(model, stack)
        if not chosen and not GROUPS[name].may_be_empty:
            raise ScopeError(f"trainable_groups: the group {name!r} selects no parameters in {type(model).__name__} "
                             f"(e.g. a model without biases); valid groups: {', '.join(GROUPS)}.")
        if chosen:
            params += chosen
            parts.append(description)
    return Scope(unique_parameters(params), " + ".join(parts), head_modules=[n for n, _ in head])
