"""Load a checkpoint's weights back into the live model exactly, or refuse (resume, `load_best_model_at_end`).

transformers 5.x `save_pretrained` writes some models (ViT, ...) under their legacy key names (it reverts the
model's weight conversions), while `Trainer._load_from_checkpoint` reads the file back with a plain
`load_state_dict`: those tensors come out as "missing"/"unexpected", a warning is logged and training goes on
from the wrong weights. Here the file is read through the same conversions, applied forward by transformers'
own `convert_and_load_state_dict_in_model` (what `from_pretrained` runs); the values are copied into the live
tensors in place (the optimizer, tied weights, frozen flags and Opacus hooks keep pointing at them); and any
tensor missing, unexpected or of another shape is an error. PEFT checkpoints: the active adapter's file must
hold exactly what saving the model now would write.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ... import errors

SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_WEIGHTS, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def load_checkpoint_weights(model: nn.Module, checkpoint: str) -> None:
    """Restore every tensor of `model` from the checkpoint folder `checkpoint`, in place; raise
    `CheckpointMismatchError` naming the missing/unexpected/mis-shaped tensors if it does not fit exactly."""
    from ...scope.lora import is_peft_model

    if is_peft_model(model):
        _load_adapter(model, checkpoint)
        return
    from transformers import PreTrainedModel

    state_dict, source = _read_weights(checkpoint)
    originals = _tensor_slots(model)
    if not isinstance(model, PreTrainedModel):  # a plain torch module: saved under its own state_dict keys
        result = model.load_state_dict(state_dict, strict=False)
        _raise_if_any({"missing from the checkpoint (left untouched)":
                       sorted(_really_missing(model, set(result.missing_keys), originals)),
                       "unexpected (not in the model)": sorted(result.unexpected_keys)}, source)
        return
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    previous = model.__dict__.get("_weight_conversions", _UNSET)
    config = LoadStateDictConfig(weight_mapping=_save_conversions(model))
    try:
        info, _ = convert_and_load_state_dict_in_model(model, state_dict, config)
    finally:
        _put_back(originals)
        if previous is _UNSET:
            model.__dict__.pop("_weight_conversions", None)
        else:
            model._weight_conversions = previous
    missing = _really_missing(model, info.missing_keys, originals)
    problems = {
        "missing from the checkpoint (left untouched)": sorted(missing),
        "unexpected (not in the model)": sorted(info.unexpected_keys),
        "of another shape (name, checkpoint, model)": sorted(str(m) for m in info.mismatched_keys),
        "failed to convert": [f"{k}: {v}" for k, v in info.conversion_errors.items()] + list(info.error_msgs),
    }
    _raise_if_any(problems, source)


# ---- plain HF models --------------------------------------------------------------------------------------
_UNSET = object()


def _read_weights(checkpoint: str) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of the checkpoint's weights (single file or shards), on CPU, and the file that names them."""
    from safetensors.torch import load_file

    for index_name, loader in ((SAFE_INDEX, load_file), (BIN_INDEX, _torch_load)):
        index = os.path.join(checkpoint, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            state = {}
            for shard in shards:
                state.update(loader(os.path.join(checkpoint, shard)))
            return state, index
    for name, loader in ((SAFE_WEIGHTS, load_file), (BIN_WEIGHTS, _torch_load)):
        path = os.path.join(checkpoint, name)
        if os.path.isfile(path):
            return loader(path), path
    raise errors.CheckpointMismatchError(f"DPTrainer: no model weights ({SAFE_WEIGHTS}, {BIN_WEIGHTS} or a sharded "
                                         f"index) in {checkpoint}; resume only from checkpoints written by DPTrainer.")


def _torch_load(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _save_conversions(model: nn.Module) -> list:
    """The weight conversions `save_pretrained` reverted when writing `model` (same choice as transformers'
    `revert_weight_conversion`), to apply them forward when reading it back."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    return list(conversions)


def _tensor_slots(model: nn.Module) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    """(module, "_parameters"/"_buffers", name, tensor) for every registered tensor, tied ones included."""
    slots = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None:
                    slots.append((module, kind, f"{prefix}.{name}" if prefix else name, tensor))
    return slots


def _put_back(slots) -> None:
    """The loader swaps in new tensors; copy their values into the original ones and register those again."""
    with torch.no_grad():
        for module, kind, full_name, original in slots:
            name = full_name.rsplit(".", 1)[-1]
            current = getattr(module, kind).get(name)
            if current is not original:
                if current is not None and current.shape == original.shape:
                    original.copy_(current)
                getattr(module, kind)[name] = original


def _really_missing(model: nn.Module, missing: set[str], slots) -> set[str]:
    """Missing keys minus tied aliases of a loaded tensor (GPT-2's lm_head is wte) and keys the model never saves."""
    aliases: dict[int, set[str]] = {}
    for _, _, name, tensor in slots:
        aliases.setdefault(id(tensor), set()).add(name)
    group = {name: aliases[id(tensor)] for _, _, name, tensor in slots}
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
    return {key for key in missing if key not in ignored and group.get(key, {key}) <= missing}


# ---- PEFT adapters ----------------------------------------------------------------------------------------
def read_adapter_weights(model, checkpoint: str) -> tuple[str, str, dict]:
    """(the active adapter, its folder in `checkpoint`, its saved tensors), or CheckpointMismatchError naming the
    folder."""
    from peft.utils import load_peft_weights

    adapter = model.active_adapters[0]
    folder = checkpoint if adapter == "default" else os.path.join(checkpoint, adapter)
    try:
        return adapter, folder, load_peft_weights(folder, device="cpu")
    except (OSError, ValueError) as e:
        raise errors.CheckpointMismatchError(f"DPTrainer: no weights of adapter {adapter!r} in {folder} ({e}); resume "
                                             "only from checkpoints written by DPTrainer with the same peft_config."
                                             ) from None


def _load_adapter(model, checkpoint: str) -> None:
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    adapter, folder, weights = read_adapter_weights(model, checkpoint)
    expected = get_peft_model_state_dict(model, adapter_name=adapter)
    problems = {
        "missing from the checkpoint (left untouched)": sorted(set(expected) - set(weights)),
        "unexpected (not in the model)": sorted(set(weights) - set(expected)),
        "of another shape (name, checkpoint, model)": sorted(
            str((k, tuple(weights[k].shape), tuple(v.shape))) for k, v in expected.items()
            if k in weights and weights[k].shape != v.shape),
    }
    _raise_if_any(problems, folder)
    result = set_peft_model_state_dict(model, weights, adapter_name=adapter)
    _raise_if_any({"unexpected (not in the model)": sorted(result.unexpected_keys)}, folder)


def _raise_if_any(problems: dict[str, list[str]], source: str) -> None:
    problems = {what: keys for what, keys in problems.items() if keys}
    if not problems:
        return
    lines = [f"{len(keys)} tensor(s) {what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
             for what, keys in problems.items()]
    raise errors.CheckpointMismatchError(
        f"DPTrainer: the checkpoint {source} does not fit the model exactly; continuing would train from other "
        "weights than those checkpointed, while the privacy ledger keeps the ε already spent.\n  "
        + "\n  ".join(lines)
        + "\nFix: resume with the same model class, config and peft_config as the run that wrote the checkpoint "
        "(and the same transformers/peft versions)."
    )

