"""Linear probing on cached backbone features.

In a linear probe only the head trains; the frozen backbone runs in eval mode (`set_probe_modes`: it is not
trained, so its dropout would only make its features random; the head keeps train mode), so the head sees the
same input for an example at every epoch. We compute those inputs once (one batched forward pass over the
training set, eval mode, no autograd) and run DP-SGD on the head alone over them, so an epoch costs a head-sized
step. The DP mechanism is unchanged: the same Poisson batches, per-example clipping and noise, over the same n
examples.

Caching is only done when it gives the same updates as running the backbone:
- the head is one module whose output is the model's logits (checked on the first batch);
- the head shares no parameter with the backbone (a tied `lm_head` is also the input embedding);
- the dataset is a `datasets.Dataset` with no transform (random augmentation), unless forced.

The inputs are kept in the process-wide `feature_store` (keyed by the backbone's weights and the dataset), so the
evaluation set's are computed once too and the probe is evaluated on them, and later `train()` calls (a sweep's
trials) reuse the training set's.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ..errors import DPConfigError
from .feature_store import (
    NotCacheable,
    data_reason_not_to_cache,
    dataset_key,
    evict_until,
    lookup,
    store,
    weights_digest,
)

HEAD_INPUTS_KEY = "_dp_head_inputs"  # the evaluation batches' key of the cached head inputs


class CachedHeadInputs(Dataset):
    """The head's input for each training example, with its label."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor):
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"features": self.features[i], "labels": self.labels[i]}

    folder = None  # an in-memory feature_store entry

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.features, self.labels))

    def delete(self) -> None:
        pass


def head_inputs_collator(items: list[dict]) -> dict:
    """Evaluation batches of cached head inputs, under a key no dataset column can take."""
    return {HEAD_INPUTS_KEY: torch.stack([x["features"] for x in items]),
            "labels": torch.stack([torch.as_tensor(x["labels"]) for x in items])}


def structural_reason_not_to_cache(model: torch.nn.Module, head_names: list[str]) -> str | None:
    """Why the head cannot run on cached inputs, from the model's structure alone (None if it can)."""
    if len(head_names) != 1:
        return f"the head is {len(head_names)} modules ({', '.join(head_names)}), not one"
    head = model.get_submodule(head_names[0])
    head_ids = {id(p) for p in head.parameters()}
    shared = [n for n, p in model.named_parameters(remove_duplicate=False)
              if id(p) in head_ids and not n.startswith(head_names[0] + ".")]
    if shared:
        return f"the head shares parameters with the backbone ({', '.join(shared)}): training it changes the features"
    return None


def set_probe_modes(model: torch.nn.Module, head_names: list[str]) -> None:
    """Linear probe: the frozen backbone (everything but the head) in eval mode, the head in train mode, and so is
    any module holding a trained parameter (a head tied to the input embedding): Opacus computes per-example
    gradients only for modules in train mode."""
    model.eval()
    for name in head_names:
        model.get_submodule(name).train()
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            module.train()


def compute_head_inputs(model: torch.nn.Module, head_name: str, loader: DataLoader, device: torch.device,
                        show_progress: bool = True) -> CachedHeadInputs:
    """Run the model once over `loader`, in eval mode (as the probe's backbone runs), and keep what enters the head.

    Raises `NotCacheable` if the head's output is not the model's logits."""
    head = model.get_submodule(head_name)
    seen: dict[str, torch.Tensor] = {}

    def keep(_module, args, output):
        seen["input"], seen["output"] = args[0].detach(), output.detach()

    handle = head.register_forward_hook(keep)
    features, labels = [], []
    was_training = model.training
    try:
        for i, batch in enumerate(tqdm(loader, desc="caching head inputs", disable=not show_progress)):
            batch = {k: v.to(device) for k, v in batch.items()}
            y = batch.pop("labels", None)  # public rows for `probe_preconditioning` come without
            model.eval()
            with torch.no_grad():
                logits = model(**batch).logits
            if i == 0:
                if seen["output"].shape != logits.shape or not torch.equal(seen["output"], logits):
                    raise NotCacheable(f"the output of `{head_name}` is not the model's logits "
                                       "(the model post-processes it)")
            features.append(seen["input"].cpu())
            labels.append(y.cpu() if y is not None else torch.full((len(logits),), -100))
    finally:
        handle.remove()
        model.train(was_training)
    return CachedHeadInputs(torch.cat(features), torch.cat(labels))


def head_inputs_for(model: torch.nn.Module, head_name: str, dataset, collator, args) -> CachedHeadInputs:
    """The head inputs of `dataset` (computed now unless this process has them for the same backbone weights),
    kept in the feature store when they fit `cache_features_max_memory_gb`."""
    prefix = head_name + "."
    backbone = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if not n.startswith(prefix)]
    key = (type(model).__name__, "head", head_name, weights_digest(backbone + list(model.named_buffers())),
           *dataset_key(dataset, collator))
    if (inputs := lookup(key)) is not None:
        return inputs
    loader = DataLoader(dataset, batch_size=args.per_device_eval_batch_size, collate_fn=collator)
    inputs = compute_head_inputs(model, head_name, loader, args.device, show_progress=not args.disable_tqdm)
    bound = args.cache_features_max_memory_gb * 2**30
    if inputs.nbytes <= bound:
        evict_until(bound - inputs.nbytes)
        store(key, inputs)
    return inputs


def prepare_cached_head(model: torch.nn.Module, scopes: list, args, train_dataset, dataset_and_collator
                        ) -> tuple[str | None, CachedHeadInputs | None, str | None]:
    """(head module name, its cached inputs, None) when this run is a linear probe that may train on cached
    inputs (`args.cache_features`: None = when safe, True = always, False = never); else (None, None, why not),
    where "why not" is None when no linear probe was asked for. `dataset_and_collator()` gives the training data
    as the Trainer would feed it."""
    head_only = len(scopes) == 1 and scopes[0].head_only
    if args.cache_features is False or not head_only or train_dataset is None:
        return None, None, None  # trainable_blocks=k: the frozen prefix is cached instead (prefix_cache)
    forced = bool(args.cache_features)
    head_names = scopes[0].head_modules
    reason = structural_reason_not_to_cache(model, head_names)
    if reason is None and not forced:
        reason = data_reason_not_to_cache(train_dataset)
    if reason is None:
        dataset, collator = dataset_and_collator()
        try:
            return head_names[0], head_inputs_for(model, head_names[0], dataset, collator, args), None
        except NotCacheable as e:
            reason = str(e)
    if forced:
        raise DPConfigError(f"DPTrainer: cache_features=True, but {reason}.")
    return None, None, reason
