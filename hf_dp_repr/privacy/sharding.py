"""Sharded DP-SGD (FSDP2): the model side. The parameters of a model that does not fit one device are sharded over
the processes with torch's `fully_shard` (each transformer block one group, then the root, which holds what is left,
tied embeddings included); the DP-SGD machinery then works on the shards:

- per-example norms are complete on each rank (activations are not sharded): each rank clips its own examples, with
  the gathered weights FSDP2 puts on the modules during forward and backward (`parameter_keys` maps them back to the
  sharded parameters, the keys of the norms and sums);
- each tensor's clipped sum is reduce-scattered (SUM) as soon as it is formed into this rank's shard of a float32
  accumulator (`privacy.reduction`, "fsdp2"); no rank ever holds more than one full clipped sum;
- Gaussian noise is added once per coordinate: each rank noises the rows it owns (Shard(0): disjoint, covering
  every coordinate) from the run's secret, on a stream of its own (`DPRandomness.noise_generator(step, device,
  shard=rank)`);
- book-keeping, as unsharded: autograd forms no parameter gradient, so FSDP2 never reduce-scatters an unclipped one.

torch < 2.9 is refused for sharded runs (`check_torch_supports_sharding`). The device comes from the process group
(gloo: CPU, NCCL: the current CUDA device), so the same code runs on CPU and GPU.

Example (what is refused, and why):
    >>> from hf_dp_repr.privacy.sharding import check_torch_supports_sharding
    >>> try:
    ...     check_torch_supports_sharding("2.8.0")
    ... except ValueError as err:
    ...     print(str(err)[:61])
    sharded DP-SGD (fsdp) needs torch >= 2.9; this is torch 2.8.0
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DPConfigError, ProcessGroupError
from ..scope.shards import is_dtensor

MIN_TORCH = (2, 9)
_WHY_TORCH = ("gloo's reduce-scatter with AVG silently sums on torch 2.7-2.8 (pytorch/pytorch#162338) and FSDP2 on CPU "
              "fails on 2.5-2.6; the FSDP2 and DTensor paths a sharded run goes through are not ours to audit, so one "
              "floor holds for every backend")


def check_torch_supports_sharding(version: str | None = None) -> None:
    """Refuse (DPConfigError) a torch older than `MIN_TORCH` for a sharded run, naming the version and the reason."""
    version = version or torch.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < MIN_TORCH:
        raise DPConfigError(f"sharded DP-SGD (fsdp) needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}; this is torch "
                            f"{version}: {_WHY_TORCH}. Fix: upgrade torch, or train without fsdp (DDP).")


def base_type(module: nn.Module) -> type:
    """The module's own class: `fully_shard` swaps a module's class for `FSDP<Class>` (a subclass); rule registries
    keyed by exact type (Opacus' grad samplers and validators) look the original up."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if not issubclass(cls, FSDPModule):
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))


def is_sharded(model: nn.Module | None) -> bool:
    """Whether any parameter of `model` is a DTensor (sharded by FSDP2, here or at load time)."""
    return model is not None and any(is_dtensor(p) for p in model.parameters())


def _process_group() -> tuple[int, str]:
    """(world size, device type of the mesh): the device follows the process group's backend."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupError("sharded DP-SGD (fsdp) needs a torch.distributed process group, and this process has "
                                "none: it was started alone. Fix: launch it with `accelerate launch --config_file "
                                "recipes/accelerate_configs/cpu_2proc.yaml` (or multi_gpu_sharded.yaml, or torchrun), "
                                "or drop fsdp.")
    backend = dist.get_backend()
    if backend == "gloo":
        return dist.get_world_size(), "cpu"
    accelerator = torch.accelerator.current_accelerator()
    return dist.get_world_size(), accelerator.type if accelerator is not None else "cpu"


def shard_model(model: nn.Module, block_classes=None, reshard_after_forward: bool = True) -> list[str]:
    """Shard `model` in place with FSDP2 over every process: each module whose class is named in `block_classes`
    (None: the model's `_no_split_modules`, the base model's for PEFT; empty: none) becomes a group, then the root
    (what is left, tied weights included). Returns the paths of the groups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_torch_supports_sharding()
    world, device = _process_group()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or () if block_classes is None else block_classes)
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("fsdp",))
    groups = [(path, m) for path, m in model.named_modules() if path and type(m).__name__ in names]
    for path, module in reversed(groups):  # innermost first: a group takes the parameters no group below took
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return [path for path, _ in groups] + ["<root>"]


def check_sharded_model(model: nn.Module) -> None:
    """A model that arrives sharded (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W))`, or
    sharded by hand) must be what the DP reduction assumes: every parameter a DTensor sharded on dim 0 over a 1-D
    mesh of all processes (no tensor/pipeline/expert parallelism, no replication, no CPU offload)."""
    from torch.distributed.tensor import Shard

    world, _ = _process_group()
    plain = [n for n, p in model.named_parameters() if not is_dtensor(p)]
    if plain:
        raise DPConfigError(f"DPTrainer: the model is partly sharded: {len(plain)} parameter(s) are not DTensors "
                            f"({', '.join(plain[:4])}{' ...' if len(plain) > 4 else ''}), e.g. adapters attached "
                            "after sharding. Fix: attach them before sharding (pass the unsharded model with "
                            "peft_config and fsdp=True: DPTrainer shards it), or load the model unsharded.")
    for name, p in model.named_parameters():
        mesh = p.device_mesh
        if mesh.ndim != 1 or mesh.size() != world or tuple(p.placements) != (Shard(0),):
            raise DPConfigError(f"DPTrainer: {name} is sharded as {tuple(p.placements)} over a mesh of shape "
                                f"{tuple(mesh.shape)}; sharded DP-SGD supports FSDP2 alone: Shard(0) over all {world} "
                                "processes (no tensor, pipeline or expert parallelism, no replication). Fix: "
                                "DistributedConfig(fsdp_size=world size) alone, or pass fsdp=True and an unsharded "
                                "model.")
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    for option in ("fsdp_cpu_offload", "fsdp_mixed_precision"):
        if getattr(config, option, None):
            raise DPConfigError(f"DPTrainer: distributed_config.{option} is set; sharded DP-SGD clips and noises "
                                "float32 sums on the device of the shards. Fix: load without it.")


def reshard(model: nn.Module) -> None:
    """Put the sharded parameters back on every FSDP2 module (a forward without backward leaves some gathered)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def parameter_keys(model: nn.Module) -> dict[tuple[nn.Module, str], nn.Parameter]:
    """(module, attribute) → the sharded parameter it stands for. FSDP2 puts all-gathered parameters on the modules
    during forward and backward; the clipping engine keys each use by the sharded one (tied weights: one key)."""
    reshard(model)
    return {(m, name): p for m in model.modules() for name, p in m.named_parameters(recurse=False)}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict on rank 0's CPU (empty elsewhere); a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(model)  # the sharded parameters, not the weights an evaluation left gathered (reshard_after_forward=False)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Fill the sharded `model` from a full state dict held by rank 0 (others pass {}); a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reshard(model)  # into the shards, which the next forward gathers (not into weights a forward left gathered)
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                     strict=strict))
