"""`head_init`: how the task head starts. "zeros" sets the head's output layer to zero before training.

Under DP a zero-initialised classifier helps (De et al. 2022, "Unlocking high-accuracy differentially private image
classification through scale", zero-init the last layer; Mehta et al. 2023 for DP linear probes): the first noisy
steps do not have to undo a random head, and every class starts at the same logit. It uses no data.

What is zeroed: the output layer of the head, i.e. the last `nn.Linear` (in module order) among the modules
outside `model.base_model` (ViT/BERT/DINOv2 `classifier`, GPT-2 `score`, RoBERTa `classifier.out_proj`), weight
and bias. Only that layer: zeroing a hidden layer of a two-layer head as well would leave both with zero gradients
for ever. Refused: a model with no head outside its base model, a head with no Linear layer, and an output layer
whose weight is shared with another module (a tied `lm_head` is the input embedding matrix).

    >>> from hf_dp_repr.tiny import tiny_vit
    >>> model = tiny_vit()
    >>> init_head(model, "zeros")
    'classifier'
    >>> float(model.classifier.weight.abs().sum()), float(model.classifier.bias.abs().sum())
    (0.0, 0.0)
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DPConfigError

HEAD_INITS = ("default", "zeros")


def check_head_init(value: str) -> None:
    if value not in HEAD_INITS:
        raise DPConfigError(f"DPTrainingArguments: unknown head_init {value!r}; use one of {HEAD_INITS} ('default': "
                            "the model's own initialisation; 'zeros': the head's output layer set to zero).")


def output_layer(model: nn.Module) -> tuple[str, nn.Linear]:
    """(dotted name, module) of the head's output layer: the last nn.Linear outside `model.base_model`."""
    from .blocks import head_modules

    head = head_modules(model)
    if not head:
        raise DPConfigError(f"head_init='zeros': {type(model).__name__} has no head outside its base model "
                            "(`model.base_model`); load it with a task head (e.g. ...ForImageClassification).")
    linears = [(f"{name}.{sub}" if sub else name, m) for name, module in head
               for sub, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise DPConfigError(f"head_init='zeros': the head ({', '.join(n for n, _ in head)}) has no nn.Linear "
                            "output layer to zero.")
    name, layer = linears[-1]
    own = {id(p) for p in layer.parameters()}
    shared = [n for n, p in model.named_parameters(remove_duplicate=False)
              if id(p) in own and not n.startswith(name + ".")]
    if shared:
        raise DPConfigError(f"head_init='zeros': the output layer {name} shares its parameters with "
                            f"{', '.join(shared)} (tied weights); zeroing it would zero them too. Use "
                            "head_init='default' (or untie the weights).")
    return name, layer


def init_head(model: nn.Module, mode: str) -> str | None:
    """Apply `mode` to `model`'s head in place; returns the name of the layer set to zero (None for 'default')."""
    check_head_init(mode)
    if mode == "default":
        return None
    name, layer = output_layer(model)
    with torch.no_grad():
        for p in layer.parameters(recurse=False):
            p.zero_()
    return name
