"""Which parameters train: the last k transformer blocks, the head alone (linear probing), or everything.

The block stack is found from the model's structure, not from a table of model names: it is the
`nn.ModuleList` of identical modules holding the most parameters (ViT `vit.layers`, BERT `encoder.layer`, GPT-2
`transformer.h`, Llama-style `model.layers`, ...). `block_stack="dotted.path"` overrides the search.

What trains for `trainable_blocks = k`:
- the head: every module outside `model.base_model` (ViT/BERT `classifier`, GPT-2 `score` or `lm_head`).
  A head tied to the input embeddings (GPT-2's `lm_head` is `wte`) trains them too: they are one tensor.
- k = 0: the head alone (linear probing).
- 1 ≤ k ≤ L: the last k blocks, the modules that follow the stack inside the base model (final norm
  `layernorm`/`ln_f`/`norm`, BERT's `pooler`) and the head.
- The embeddings (patch/token embeddings, [CLS] token, position embeddings) sit below block 1: they train
  only with `trainable_blocks=None` (full fine-tuning), never with k = L.
`trainable_blocks=k` is the short form of `trainable_groups="last:k,final,head"` (k = 0: `"head"`), see `groups`:
the same parameters train, in the same modes.

Example:
    >>> from hf_dp_repr.scope import find_block_stack, select_scope
    >>> from hf_dp_repr.tiny import tiny_vit
    >>> model = tiny_vit()
    >>> find_block_stack(model)[0]
    'vit.layers'
    >>> scope = select_scope(model, trainable_blocks=1)
    >>> scope.description
    'last 1 of 4 blocks (vit.layers.3) + vit.layernorm + head (classifier)'
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ScopeError
from .lora import has_peft_adapters


@dataclass
class Scope:
    """A set of parameters to train, with a one-line description for logs and the model card.

    `head_only`: a linear probe (the backbone runs in eval mode; the head may train on cached inputs).
    `frozen_prefix`: the blocks below its lowest trained block and the embeddings are frozen, so they run in eval
    mode and may be cached (`prefix_cache`); False for "train whatever requires grad" (full fine-tuning, LoRA)."""

    parameters: list[nn.Parameter]
    description: str
    head_only: bool = False
    head_modules: list[str] = field(default_factory=list)
    frozen_prefix: bool = True

    def apply(self, model: nn.Module) -> None:
        """Make exactly this scope trainable (requires_grad) and freeze everything else."""
        keep = {id(p) for p in self.parameters}
        for p in model.parameters():
            p.requires_grad_(id(p) in keep)


def find_block_stack(model: nn.Module, block_stack: str | None = None) -> tuple[str, nn.ModuleList]:
    """The model's stack of transformer blocks as (dotted name, ModuleList).

    Without `block_stack`, the `nn.ModuleList` of same-type modules with the most parameters."""
    if block_stack is not None:
        try:
            stack = model.get_submodule(block_stack)
        except AttributeError:
            raise ScopeError(f"block_stack={block_stack!r}: {type(model).__name__} has no such submodule. Give the "
                             f"dotted name of its list of blocks (ModuleLists here: {_module_lists(model)}).") from None
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)) or len(stack) == 0:
            raise ScopeError(f"block_stack={block_stack!r} is a {type(stack).__name__}, not a non-empty ModuleList of "
                             f"blocks. ModuleLists in this model: {_module_lists(model)}.")
        return block_stack, stack
    best, best_size = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (name, module), size
    if best is None:
        raise ScopeError(f"{type(model).__name__}: no stack of transformer blocks found (no ModuleList of identical "
                         "modules with parameters). Name it with the block_stack argument, e.g. "
                         "block_stack='encoder.layer'.")
    return best


def head_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level modules with parameters outside `model.base_model`: the task head (empty for a bare backbone)."""
    base = getattr(model, "base_model", model)
    if base is model:
        return []
    return [(name, child) for name, child in model.named_children()
            if child is not base and any(True for _ in child.parameters())]


def select_scope(model: nn.Module, trainable_blocks: int, block_stack: str | None = None) -> Scope:
    """The scope of `trainable_blocks = k`: head only for k = 0, else the last k blocks + what follows + head."""
    if has_peft_adapters(model):
        raise ScopeError("trainable_blocks with a PEFT model: LoRA already decides what trains (the adapters). "
                         "Use either peft_config or trainable_blocks, not both.")
    head = head_modules(model)
    head_params = [p for _, m in head for p in m.parameters()]
    head_text = f"head ({', '.join(n for n, _ in head)})"
    if trainable_blocks < 0:
        raise ScopeError(f"trainable_blocks={trainable_blocks}: must be >= 0 (0 = linear probe: head only).")
    if trainable_blocks == 0:
        if not head_params:
            raise ScopeError(f"trainable_blocks=0 (linear probe): {type(model).__name__} has no head outside its "
                             "base model to train. Load the model with a task head (e.g. ...ForImageClassification).")
        return linear_probe_scope(model)
    name, stack = find_block_stack(model, block_stack)
    depth = len(stack)
    if trainable_blocks > depth:
        raise ScopeError(f"trainable_blocks={trainable_blocks}, but {type(model).__name__} has {depth} blocks in "
                         f"{name}; use 0..{depth} (0 = linear probe), or None to train every parameter.")
    first = depth - trainable_blocks
    after = modules_after(model, name)
    params = [p for block in list(stack)[first:] for p in block.parameters()]
    params += [p for _, m in after for p in m.parameters()] + head_params
    blocks = f"{name}.{first}" if trainable_blocks == 1 else f"{name}.{first}-{depth - 1}"
    parts = [f"last {trainable_blocks} of {depth} blocks ({blocks})"]
    parts += [n for n, m in after if any(True for _ in m.parameters())]
    if head_params:
        parts.append(head_text)
    return Scope(unique_parameters(params), " + ".join(parts), head_modules=[n for n, _ in head])


def linear_probe_scope(model: nn.Module) -> Scope:
    """The head alone (`trainable_blocks=0`, `trainable_groups="head"`), the backbone frozen in eval mode."""
    head = head_modules(model)
    return Scope(unique_parameters([p for _, m in head for p in m.parameters()]),
                 f"linear probe: head ({', '.join(n for n, _ in head)})", head_only=True,
                 head_modules=[n for n, _ in head])


def block_stack_name(model: nn.Module, block_stack: str | None = None) -> str | None:
    """The block stack's path, or None when the model has none."""
    try:
        return find_block_stack(model, block_stack)[0]
    except ValueError:
        return None


def describe_trainable(model: nn.Module, parameters, noise_multiplier: float, max_grad_norm: float, batch_size: int,
                       block_stack_name: str | None = None) -> str:
    """A table of what trains (module, parameters) and the noise each parameter receives per step."""
    keep = {id(p) for p in parameters}
    rows: dict[str, int] = {}
    for name, p in model.named_parameters():
        if id(p) in keep:
            key = _group_key(name, block_stack_name)
            rows[key] = rows.get(key, 0) + p.numel()
    total = sum(p.numel() for p in model.parameters())
    trained = sum(rows.values())
    width = max([len(k) for k in rows] + [len("trainable")])
    lines = [f"  {'module':<{width}}  {'parameters':>12}"]
    lines += [f"  {k:<{width}}  {v:>12,}" for k, v in rows.items()]
    lines.append(f"  {'trainable':<{width}}  {trained:>12,}  of {total:,} ({100 * trained / max(total, 1):.2f} %)")
    per_coord = noise_multiplier * max_grad_norm / batch_size
    lines.append(f"  noise per parameter per step: std σ·C/B = {per_coord:.3g}; noise norm over these parameters "
                 f"σ·C·√P/B = {per_coord * trained ** 0.5:.3g} (a clipped example contributes at most C/B = "
                 f"{max_grad_norm / batch_size:.3g})")
    return "\n".join(lines)


def _group_key(param_name: str, block_stack_name: str | None) -> str:
    module = param_name.rsplit(".", 1)[0] if "." in param_name else param_name
    if block_stack_name and module.startswith(block_stack_name + "."):
        index = module[len(block_stack_name) + 1:].split(".", 1)[0]
        return f"{block_stack_name}.{index}"
    return module


def modules_after(model: nn.Module, stack_name: str) -> list[tuple[str, nn.Module]]:
    """Modules registered after the block stack at each level of its path inside the base model: in HF models
    registration follows the forward order, so these are the final norm and pooler."""
    base = getattr(model, "base_model", model)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    after, parent, path = [], model, stack_name.split(".")
    for depth, part in enumerate(path):
        names = [n for n, _ in parent.named_children()]
        here = ".".join(path[:depth])
        inside_base = here == prefix or here.startswith(prefix + ".") if prefix else True
        if inside_base and part in names:
            for n in names[names.index(part) + 1:]:
                after.append((f"{here}.{n}" if here else n, parent.get_submodule(n)))
        parent = parent.get_submodule(part)
    return after


def _module_lists(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)][:8]


def unique_parameters(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """`params` without repeats (a tied tensor listed by two modules), in first-seen order."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
