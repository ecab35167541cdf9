"""`probe_preconditioning` in `DPTrainer` (`scope.preconditioning`): fitted on `public_train_dataset` alone when
training starts, in front of the linear probe while it trains, folded into the plain head for every save and after
training.

Refused before any work: no public_train_dataset, one that shares rows with the private training set, a scope that
is not a linear probe in every phase (the features would move under the statistics).

Sharded (FSDP2): every rank computes the public features (the sharded forward is a collective) and fits the same
statistics; the head keeps its sharded shape (`scope.preconditioning.install`: z padded with zeros) and is folded
whole for every save, as the model is gathered whole.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.data import DataLoader
from transformers.utils import logging

from ..errors import DPConfigError, ScopeError
from ..privacy.sharding import reshard
from ..scope.cached_head import head_inputs_for
from ..scope.feature_store import NotCacheable
from ..scope.preconditioning import PreconditionedHead, fit_preconditioner, install, parse_preconditioning, remove
from ..scope.shards import assign
from . import TRAINER_LOGGER

logger = logging.get_logger(TRAINER_LOGGER)


def check_preconditioning(trainer) -> None:
    """Before any work: what the preconditioning needs (see the module docstring)."""
    from .eval_overlap import shared_rows

    spec = trainer.args.probe_preconditioning
    if parse_preconditioning(spec)[0] == "none":
        return
    public = trainer.public_train_dataset
    if public is None:
        raise DPConfigError(f"DPTrainer: probe_preconditioning={spec!r} is fitted on public data only; pass "
                            "DPTrainer(..., public_train_dataset=...) (unlabelled rows are enough), or set "
                            "probe_preconditioning='none'.")
    overlap = shared_rows(trainer.train_dataset, public)
    if overlap is not None and overlap.private is None:
        raise DPConfigError(f"DPTrainer: public_train_dataset cannot be checked against the private training set "
                            f"({overlap.description}); statistics fitted on private rows would not be private. Give "
                            "both as datasets.Dataset or torch datasets whose rows are dicts.")
    if overlap is not None:
        raise DPConfigError("DPTrainer: public_train_dataset shares rows with the private training set "
                            f"({overlap.description}); statistics fitted on it would depend on private rows. Give "
                            "disjoint public data.")
    if not trainer._scopes or not all(s.head_only for s in trainer._scopes):
        raise ScopeError(f"DPTrainer: probe_preconditioning={spec!r} is for a linear probe (trainable_blocks=0 or "
                         "trainable_groups='head', without lp_steps): when the backbone trains, the features move "
                         "away from the public statistics. Set probe_preconditioning='none' for this scope.")


def public_head_inputs(model, head_name: str, dataset, collator, args) -> torch.Tensor:
    """What enters the head for every row of the PUBLIC `dataset` (eval mode, no labels needed)."""
    seen = []
    handle = model.get_submodule(head_name).register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach().cpu()))
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in DataLoader(dataset, batch_size=args.per_device_eval_batch_size, collate_fn=collator):
                batch = {k: v.to(args.device) for k, v in batch.items() if k != "labels"}
                model(**batch)
    finally:
        handle.remove()
        model.train(training)
    return torch.cat(seen)


def start_preconditioning(trainer) -> None:
    """Fit on the public set's head inputs and put the preconditioner in front of the head
    (`trainer._preconditioned`: the head's path while it is there)."""
    spec = trainer.args.probe_preconditioning
    if parse_preconditioning(spec)[0] == "none" or trainer._preconditioned is not None:
        return
    check_preconditioning(trainer)
    (head_name,) = trainer._scopes[-1].head_modules
    public = trainer.public_train_dataset
    if hasattr(public, "column_names"):
        public = trainer._remove_unused_columns(public, description="public preconditioning")
    features = None
    if not trainer.sharded:  # kept in the process's feature store: a sweep's or a benchmark's later runs reuse them
        with contextlib.suppress(NotCacheable):  # a head whose output the model post-processes: computed below
            features = head_inputs_for(trainer.model, head_name, public, trainer.data_collator, trainer.args).features
    if features is None:  # sharded: every rank runs the sharded forward
        features = public_head_inputs(trainer.model, head_name, public, trainer.data_collator, trainer.args)
    _settle(trainer)
    install(trainer.model, head_name, fit_preconditioner(features, spec))
    trainer._preconditioned = head_name
    logger.info(f"DPTrainer: probe_preconditioning={spec!r} fitted on {len(features)} public rows; the probe "
                f"trains on {trainer.model.get_submodule(head_name)[0].dims} inputs.")


def _settle(trainer) -> None:
    """Sharded: the head's module holds its DTensors again (a forward without backward, e.g. on the public set or
    an evaluation with reshard_after_forward=False, leaves the gathered weights on the modules)."""
    if trainer.sharded:
        reshard(trainer.model)


@contextlib.contextmanager
def folded_head(trainer):
    """The plain head (preconditioning folded in) for the duration; the exact head on z afterwards."""
    name = trainer._preconditioned
    if name is None:
        yield
        return
    _settle(trainer)
    head = trainer.model.get_submodule(name)[1]
    kept = [p.detach().clone() for p in head.parameters()]  # (sharded: clones of this rank's shards)
    pre, head = remove(trainer.model, name)
    try:
        yield
    finally:
        for p, value in zip(head.parameters(), kept):
            assign(p, value)
        head.in_features = head.weight.shape[1]
        trainer.model.set_submodule(name, PreconditionedHead(pre, head))


def finish_preconditioning(trainer) -> None:
    """The end of train(): the model's head is plain again, the preconditioning folded into it."""
    if trainer._preconditioned is not None:
        _settle(trainer)
        remove(trainer.model, trainer._preconditioned)
        trainer._preconditioned = None
