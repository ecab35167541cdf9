"""The per-sample gradient rules this package adds to Opacus' registry: a `Registry` (module class → rule) filled by
the module families in `privacy/modules/` (each registers, in one file, its per-sample rule here and its ghost rule
in `ghost_rules.py`), and `register_grad_samplers()`, which puts them into Opacus' own registry
(`opacus.grad_sample.register_grad_sampler`). `privacy/modules/__init__.py` calls it once, after every family has
registered: every module that hooks a model imports `privacy.modules`, so the rules are in place first, and the
torch-free parts of `privacy` (the accountants) load none of this.

Without them Opacus falls back to functorch, which re-runs each module per example: correct but slow.
Each rule receives the module's inputs (`activations`) and the gradient of the loss with respect to its
output (`backprops`), both with the batch first, and returns {parameter: per-sample gradient}.
"""

from __future__ import annotations

import inspect

import torch
from opacus.grad_sample import register_grad_sampler

from ..registry import Registry

HF_GRAD_SAMPLERS = Registry("per-sample rule")  # module class → its rule; `register_grad_samplers` installs these


def register_per_sample_rule(module_class: type, *, replace: bool = False):
    """Decorator: `rule(layer, activations, backprops) -> {param: per-sample gradient}` for `module_class`,
    installed into Opacus by `register_grad_samplers()` (when `privacy.modules` loads, for the built-in families)."""
    def register(rule):
        HF_GRAD_SAMPLERS.add(module_class, rule, replace=replace)
        return rule
    return register


def examples_first(rule):
    """A rule for modules that may see several rows per example: OPT's MLP and its LayerNorm see (B·T, d). For
    them `ExampleRows` (privacy/batch_rows.py) sets Opacus' `max_batch_len` to the number of examples B (Opacus'
    own mechanism for packed sequences); the rows, example-major (checked at the start of training), are then
    viewed as (B, T, ...) and each example's gradient sums over its rows."""
    def per_example(layer, activations, backprops):
        n = getattr(layer, "max_batch_len", backprops.shape[0])
        if backprops.shape[0] != n:
            activations = [a.reshape(n, -1, *a.shape[1:]) for a in activations]
            backprops = backprops.reshape(n, -1, *backprops.shape[1:])
        return rule(layer, activations, backprops)

    per_example.__name__ = per_example.__qualname__ = f"examples_first_{rule.__name__}"
    return per_example


def register_grad_samplers() -> None:
    """Register `HF_GRAD_SAMPLERS` into Opacus (the hooks and the fast-clipping hooks). Idempotent: each call
    sets the same registry entries again."""
    for module_class, rule in HF_GRAD_SAMPLERS.items():
        register_grad_sampler(module_class)(rule)


def batch_position_ids(model, inputs: dict) -> None:
    """Give `position_ids` a real batch dimension. HF models build them with batch 1, which gives the position
    embedding a per-sample gradient of batch 1 (Opacus then crashes on GPT-2 and BERT)."""
    ids = inputs.get("input_ids")
    if ids is None or "position_ids" in inputs or "position_ids" not in inspect.signature(model.forward).parameters:
        return
    inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)

