"""The start-of-training probe (`DPTrainer.probe_rows`), once per model and collator: `train()` runs it on its first
call and again only when what it proves may have changed (another model object or another architecture, other
trained tensors, dtype or device, another collator, training set, privacy unit, or cached features); a resumed or
repeated `train()` of the same model on the same data reuses its result. Its cost goes into the plan line
(`privacy_report.announce_plan`).

What is compared is what the probe's verdict depends on: the structure of the model and which of its tensors train,
not their values (an example's rows are kept apart, or not, by the model's operations, whatever its weights).

    >>> from hf_dp_repr.tiny import tiny_vit
    >>> model, data = tiny_vit(), [{"pixel_values": 0}]
    >>> key = probe_key(model, None, None, data, ())
    >>> key == probe_key(model, None, None, data, ())
    True
    >>> _ = model.classifier.weight.requires_grad_(False)  # other tensors train: probed again
    >>> key == probe_key(model, None, None, data, ())
    False
"""

from __future__ import annotations

import time
import weakref

import datasets

from ..privacy.sampler import ExampleBatchCollator


def probe_key(model, scope, collator, dataset, extra: tuple) -> tuple:
    """What the probe's result depends on, comparable with `==` (objects by identity, the model by its structure)."""
    modules = tuple((name, type(m)) for name, m in model.named_modules())
    params = tuple((name, p.requires_grad, p.dtype, p.device, tuple(p.shape)) for name, p in model.named_parameters())
    scoped = None if scope is None else tuple(id(p) for p in scope.parameters)
    data = (id(dataset), len(dataset))
    if isinstance(dataset, datasets.Dataset):
        data += (dataset._fingerprint, repr(dataset.format))
    return modules, params, scoped, id(collator), data, extra


class StartChecks:
    """The probe's result for one model and collator (`DPTrainer.start_checks`), and what the last one cost."""

    def __init__(self):
        self._model = None  # a weak reference: a replaced model is not kept alive
        self._key, self._several = None, None
        self._held = None  # the collator and dataset the key names by id (held: their ids cannot be reused)
        self.seconds: float | None = None  # the last probe's time (None: the result was reused)

    def probe(self, trainer, dataset, collator, scope) -> frozenset:
        """`trainer.probe_rows` on the training set and collator as the trainer feeds them, or its earlier result."""
        model, features = trainer.model, trainer.features
        key = probe_key(model, scope, trainer.data_collator, trainer.train_dataset,
                        (trainer.args.remove_unused_columns, trainer.args.privacy_unit, features.cached_head,
                         features.prefix_cut, type(trainer)))
        if self._model is not None and self._model() is model and key == self._key:
            self.seconds = None
            return self._several
        start = time.perf_counter()
        several = frozenset(trainer.probe_rows(dataset, ExampleBatchCollator(collator), scope))
        self.seconds = time.perf_counter() - start
        self._model, self._key, self._several = weakref.ref(model), key, several
        self._held = (trainer.data_collator, trainer.train_dataset)
        return several

    def describe(self) -> str:
        """For the plan line."""
        if self.seconds is None:
            return "start-of-training probe: reused (same model and collator as the last train())"
        return f"start-of-training probe: {self.seconds:.1f} s"
