"""Layer selection beyond "the last k blocks": block indices and named parameter groups, combined as a union.

`trainable_groups` is a list (or a comma-separated string) of selectors; the parameters that train are the union
of what each selects. Nothing else trains: name `head` if the task head should train too.

Block selectors (indices into the block stack found by `scope.find_block_stack`, 0 = the block next to the
embeddings):
- an integer `i` (negative counts from the end, as in Python): block i;
- `first:k` / `last:k`: the first / last k blocks;
- `every_other`: blocks 0, 2, 4, ...; `every_other:odd`: blocks 1, 3, 5, ...

Named groups (found from the model's structure, not from a table of model names):
- `head`: the modules outside `model.base_model` (as for linear probing);
- `norms`: every normalisation module anywhere in the model (class name containing "Norm": LayerNorm, RMSNorm, ...);
- `biases`: every parameter named `bias` anywhere (BitFit, Ben Zaken et al. 2022);
- `attention`: in every block, the submodule whose name contains "attn" or "attention" (ViT/BERT `attention`,
  GPT-2 `attn`, Llama `self_attn`), its norms excluded;
- `mlp`: in every block, what is neither attention nor a norm (ViT/BERT `intermediate` + `output.dense`, GPT-2 and
  Llama `mlp`).

Example:
    >>> from hf_dp_repr.scope.groups import select_groups
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> select_groups(tiny_vit(), "first:2,norms,head").description
    'blocks 0, 1 of 4 (vit.layers) + norms + head (classifier)'
"""

from __future__ import annotations

import re

from torch import nn

from ..errors import ScopeError
from .blocks import Scope, find_block_stack, head_modules, unique_parameters

NAMED_GROUPS = ("head", "norms", "biases", "attention", "mlp")
BLOCK_SELECTORS = ("<index>", "first:k", "last:k", "every_other", "every_other:odd")
_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)


def parse_groups(spec) -> list[str | int]:
    """Selectors of `spec` (a comma-separated string or a list of names and integers), checked for syntax."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str | int] = []
    for item in items:
        token = item.strip() if isinstance(item, str) else item
        if isinstance(token, str) and re.fullmatch(r"-?\d+", token):
            token = int(token)
        if isinstance(token, bool) or not (isinstance(token, int) or token in NAMED_GROUPS
                                           or token in ("every_other", "every_other:odd")
                                           or (isinstance(token, str) and re.fullmatch(r"(first|last):\d+", token))):
            raise ScopeError(f"trainable_groups: unknown selector {item!r}. Valid: the groups {', '.join(NAMED_GROUPS)}"
                             f" and the block selectors {', '.join(BLOCK_SELECTORS)} (e.g. 'first:2,norms,head').")
        out.append(token)
    if not out:
        raise ScopeError("trainable_groups is empty; name at least one group or block (e.g. 'last:2,head').")
    return out


def block_indices(selectors: list[str | int], depth: int, stack_name: str) -> list[int]:
    """The block indices the block selectors pick, checked against the depth of the stack."""
    picked: set[int] = set()
    for s in selectors:
        if isinstance(s, int):
            if not -depth <= s < depth:
                raise ScopeError(f"trainable_groups: block index {s} is out of range: {stack_name} has {depth} blocks, "
                                 f"valid indices are 0..{depth - 1} (or -{depth}..-1 from the end).")
            picked.add(s % depth)
        elif s.startswith(("first:", "last:")):
            k = int(s.split(":")[1])
            if not 1 <= k <= depth:
                raise ScopeError(f"trainable_groups: {s!r} asks for {k} blocks, but {stack_name} has {depth}; "
                                 f"use 1..{depth}.")
            picked.update(range(k) if s.startswith("first:") else range(depth - k, depth))
        elif s.startswith("every_other"):
            picked.update(range(1 if s.endswith(":odd") else 0, depth, 2))
    return sorted(picked)


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)) or \
        "norm" in type(module).__name__.lower()


def norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)]


def attention_module(block: nn.Module, where: str) -> nn.Module:
    """The block's outermost submodule named like attention (`attention`, `attn`, `self_attn`, ...)."""
    for name, module in block.named_modules():
        if name and _ATTENTION_NAME.search(name.rsplit(".", 1)[-1]):
            return module
    children = [n for n, _ in block.named_children()]
    raise ScopeError(f"trainable_groups: no attention submodule found in {where} (its children: {children}); "
                     "the groups 'attention' and 'mlp' need a child named like 'attention' or 'attn'.")


def select_groups(model: nn.Module, spec, block_stack: str | None = None):
    """The `Scope` of `trainable_groups=spec`: the union of the selected blocks and named groups."""
    try:
        selectors = parse_groups(spec)
    except ValueError as err:
        raise ScopeError(str(err)) from None
    head = head_modules(model)
    names = [s for s in selectors if isinstance(s, str) and s in NAMED_GROUPS]
    block_selectors = [s for s in selectors if s not in names]
    params: list[nn.Parameter] = []
    parts: list[str] = []
    needs_stack = block_selectors or {"attention", "mlp"} & set(names)
    stack_name, stack = find_block_stack(model, block_stack) if needs_stack else (None, None)
    if block_selectors:
        try:
            indices = block_indices(block_selectors, len(stack), stack_name)
        except ValueError as err:
            raise ScopeError(str(err)) from None
        params += [p for i in indices for p in stack[i].parameters()]
        parts.append(f"blocks {', '.join(map(str, indices))} of {len(stack)} ({stack_name})")
    norms = {id(p) for p in norm_parameters(model)}
    for name in names:
        if name == "head":
            if not head:
                raise ScopeError(f"trainable_groups: 'head' selected, but {type(model).__name__} has no head outside "
                                 "its base model. Load the model with a task head, or drop 'head'.")
            chosen = [p for _, m in head for p in m.parameters()]
            parts.append(f"head ({', '.join(n for n, _ in head)})")
        elif name == "norms":
            chosen = norm_parameters(model)
            parts.append("norms")
        elif name == "biases":
            chosen = [p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] == "bias"]
            parts.append("biases")
        else:
            chosen = []
            for i, block in enumerate(stack):
                attention = {id(p) for p in attention_module(block, f"{stack_name}.{i}").parameters()}
                chosen += [p for p in block.parameters() if id(p) not in norms
                           and ((id(p) in attention) == (name == "attention"))]
            parts.append(f"{name} of every block ({stack_name})")
        if not chosen:
            raise ScopeError(f"trainable_groups: the group {name!r} selects no parameters in {type(model).__name__} "
                             f"(e.g. a model without biases); valid groups: {', '.join(NAMED_GROUPS)}.")
        params += chosen
    return Scope(unique_parameters(params), " + ".join(parts), head_modules=[n for n, _ in head])
