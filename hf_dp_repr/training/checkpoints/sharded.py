"""Saving and restoring a sharded (FSDP2) DPTrainer run: what is written is what one process writes.

- the model: a plain HF model (or PEFT adapter), its full state dict gathered on rank 0's CPU (a collective: every
  rank calls `save_model`, as every rank does for checkpoints) and written by rank 0 alone;
- the optimizer: its full state dict keyed by parameter names, gathered and written by rank 0 (`optimizer.pt`; the
  Trainer's own would hold rank 0's shards only), restored by broadcast from rank 0;
- resume and `load_best_model_at_end`: rank 0 reads the checkpoint into an unsharded replica through the exact loader
  (`checkpoints.weights`: transformers' key conversions applied, any missing/unexpected/mis-shaped tensor refused),
  every rank gets the same verdict, and the shards are filled by broadcast. The ledger and ε are rank-independent
  and restored as in one process.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from ... import errors
from ...privacy.sharding import base_type, full_state_dict, load_full_state_dict


@contextlib.contextmanager
def _no_distributed_config(model):
    """save_pretrained gathers a model whose config has a distributed_config (on the calling rank alone: a hang);
    the state dict is gathered already."""
    config = model.config
    saved = config.__dict__.pop("distributed_config", None)
    try:
        yield
    finally:
        if saved is not None:
            config.distributed_config = saved


def save_sharded_model(trainer, output_dir: str) -> None:
    """Every rank: gather; rank 0: the Trainer's `_save` of the full state dict (weights, config, processor, args)."""
    state = full_state_dict(trainer.model)
    if trainer.args.should_save:
        with _no_distributed_config(trainer.model):
            trainer._save(output_dir, state_dict=state)
    dist.barrier()


def save_sharded_optimizer(trainer, output_dir: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optimizer = trainer.engine.optimizer.original_optimizer
    state = get_optimizer_state_dict(trainer.model, optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.args.should_save:
        torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_sharded_optimizer(trainer, checkpoint: str) -> None:
    """As the Trainer's: nothing when the checkpoint has no optimizer and scheduler files."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    paths = [os.path.join(checkpoint, name) for name in (OPTIMIZER_NAME, SCHEDULER_NAME)]
    if not all(os.path.isfile(p) for p in paths):
        return
    state = torch.load(paths[0], map_location="cpu", weights_only=True) if dist.get_rank() == 0 else {}
    # torch broadcasts a full state tensor by tensor, to the device of the optimizer's own state, and fails ("Expected
    # device to be set") when that state holds no tensor with a dimension (plain SGD: no state at all). Such a state
    # is small (hyperparameters, step counters): rank 0 sends it whole, and each rank loads it as it is.
    small = [None if _has_state_tensors(state) else state]
    dist.broadcast_object_list(small, src=0)
    optimizer = trainer.engine.optimizer.original_optimizer
    if small[0] is not None:
        set_optimizer_state_dict(trainer.model, optimizer, small[0], options=StateDictOptions(full_state_dict=False))
    else:
        set_optimizer_state_dict(trainer.model, optimizer, state,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    trainer.lr_scheduler.load_state_dict(torch.load(paths[1], weights_only=True))


def _has_state_tensors(state: dict) -> bool:
    """Whether a saved optimizer state holds a per-parameter tensor with a dimension (AdamW's moments, SGD's momentum
    buffer), not only hyperparameters and step counts."""
    return any(isinstance(v, torch.Tensor) and v.dim() > 0 for per_param in state.get("state", {}).values()
               for v in per_param.values())


def load_sharded_weights(model, checkpoint: str) -> None:
    """Fill the sharded `model` from `checkpoint` exactly, or raise `CheckpointMismatchError` on every rank."""
    state, problem = {}, None
    if dist.get_rank() == 0:
        try:
            state = _read_exactly(model, checkpoint)
        except errors.CheckpointMismatchError as err:
            problem = str(err)
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise errors.CheckpointMismatchError(verdict[0])
    load_full_state_dict(model, state, strict=not _is_peft(model))


def _is_peft(model) -> bool:
    from ...scope.lora import is_peft_model

    return is_peft_model(model)


def _read_exactly(model, checkpoint: str) -> dict[str, torch.Tensor]:
    """Rank 0: the checkpoint's tensors under the live model's names, read by `checkpoints.weights`'s exact loader
    (into an unsharded replica; for PEFT, the adapter's tensors only)."""
    if _is_peft(model):
        return _read_adapter(model, checkpoint)
    from .weights import load_checkpoint_weights

    config = copy.deepcopy(model.config)
    config.__dict__.pop("distributed_config", None)
    with torch.device("meta"):
        replica = base_type(model)(config)
    replica.to_empty(device="cpu")
    replica.tie_weights()
    load_checkpoint_weights(replica, checkpoint)
    return replica.state_dict()


def _read_adapter(model, checkpoint: str) -> dict[str, torch.Tensor]:
    """The active adapter's saved tensors (named without the adapter, as peft saves them) under the model's names;
    exactly those peft would save now, of the same shapes, or CheckpointMismatchError."""
    from peft.utils import get_peft_model_state_dict

    from .weights import _raise_if_any, read_adapter_weights

    adapter, folder, weights = read_adapter_weights(model, checkpoint)
    saved_names = set(get_peft_model_state_dict(model, adapter_name=adapter))
    live = {name.replace(f".{adapter}", ""): name for name in model.state_dict() if
            name.replace(f".{adapter}", "") in saved_names}
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    _raise_if_any({
        "missing from the checkpoint (left untouched)": sorted(set(live) - set(weights)),
        "unexpected (not in the model)": sorted(set(weights) - set(live)),
        "of another shape (name, checkpoint, model)": sorted(
            str((k, tuple(weights[k].shape), shapes[live[k]])) for k in weights
            if k in live and tuple(weights[k].shape) != shapes[live[k]]),
    }, folder)
    return {live[k]: v for k, v in weights.items()}
