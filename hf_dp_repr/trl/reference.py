"""The frozen reference of DP DPO (`DPDPOTrainer`): which model gives the reference log-probabilities, and how it is
made ready, sharded (FSDP2) or not. Its log-probabilities carry no gradient (computed under `no_grad`).

Which model (`choose_reference`):

- `ref_model`, if given;
- a fresh LoRA adapter (`peft_config`): the base with the adapter disabled (no copy);
- `precompute_ref_log_probs=True` without `ref_model`: the model before training, run once at init;
- otherwise the initial policy: a frozen copy of the model as passed (nothing is loaded again by name); on one
  device, a PeftModel with a trained adapter keeps TRL's reference (its "ref" copy of the adapter).

TRL's `DPOTrainer.__init__` gets a `ReferenceStandIn` as `ref_model` (except in that last case): it then adds no
"ref" copy of a fresh adapter (on a sharded model that copy, between a tensor and a DTensor, fails) and hashes no
sharded model; DPDPOTrainer installs the reference after (`prepare_reference`). In a sharded run a reference model is
sharded like the policy (each block, then the root; resharded after each forward: no backward runs through it). Its
forward is then a collective, which every process runs in step: DP-SGD runs the same micro-batches on every rank
(an empty one as a stand-in row), and the probe, the precomputation and evaluation run the same batches everywhere.

Example (the choice for full fine-tuning: a frozen copy, which trains nothing):
    >>> from hf_dp_repr.tiny import tiny_llama
    >>> from hf_dp_repr.trl.dpo import DPDPOConfig
    >>> from hf_dp_repr.trl.reference import choose_reference
    >>> model = tiny_llama(vocab_size=64)
    >>> args = DPDPOConfig(output_dir="dp-dpo", target_epsilon=8.0, target_delta=1e-3, report_to="none")
    >>> ref, trl_builds_it = choose_reference(model, None, None, args, sharded=False)
    >>> ref is not model, any(p.requires_grad for p in ref.parameters()), trl_builds_it
    (True, False, False)
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ..errors import UnsupportedError
from ..privacy.sharding import check_sharded_model, is_sharded, shard_model
from ..scope.lora import has_peft_adapters
from ..training.sharding import sharding_request


class ReferenceStandIn(torch.nn.Module):
    """What TRL's `DPOTrainer.__init__` gets as `ref_model` while DPDPOTrainer chooses the reference itself (see the
    module docstring). It holds no parameters, only the policy's config (TRL's fused head reads it), and never runs."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, *args, **kwargs):
        raise UnsupportedError("ReferenceStandIn stands for the DPO reference during DPOTrainer.__init__ only; "
                               "DPDPOTrainer replaces it with the real reference before any forward.")


def frozen_copy(model):
    """The initial policy as the reference: a copy of `model`, without gradient, in eval mode."""
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


def choose_reference(model, ref_model, peft_config, args, sharded: bool):
    """(the reference model or None, whether TRL builds it): None is the policy itself, its adapter disabled for a
    fresh LoRA adapter (see the module docstring)."""
    if ref_model is not None:
        return ref_model, False
    if peft_config is not None or args.precompute_ref_log_probs:
        return None, False
    if has_peft_adapters(model) and not sharded:
        return None, True  # TRL's "ref" adapter: a copy of the trained adapter, the size of the adapter
    if is_sharded(model):
        raise UnsupportedError(
            "DPDPOTrainer: the model arrives sharded, and its reference (the initial policy) would be a copy of it, "
            "which a sharded model cannot be. Fix: pass ref_model= (the same model, loaded again, sharded or not), "
            "or precompute_ref_log_probs=True (the model's log-probabilities before training), or pass it unsharded "
            "with fsdp=True.")
    return frozen_copy(model), False


def prepare_reference(ref, args, device) -> None:
    """Ready `ref` for the reference forward as TRL readies its reference (no gradient, no dropout, TRL's fused LM
    head), on `device`; in a sharded run, sharded like the policy (`args`' block classes) unless it already is."""
    from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

    ref.requires_grad_(False)
    if args.disable_dropout:
        disable_dropout_in_model(ref)
    add_fused_lm_head(ref.get_base_model() if hasattr(ref, "get_base_model") else ref)
    request = sharding_request(args)
    if is_sharded(ref):
        check_sharded_model(ref)
    elif request is not None:
        shard_model(ref, request.block_classes, reshard_after_forward=True)
    else:
        ref.to(device)


@contextlib.contextmanager
def kept_requires_grad(model):
    """PEFT's disable_adapter / set_adapter reset the adapters' requires_grad flags; the clipper owns them."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)
