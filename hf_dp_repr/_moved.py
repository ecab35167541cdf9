"""Old module paths, from before the package was arranged by pipeline stage (issue 24; 0.1): one table, old → new.

`import hf_dp_repr.model_card` (or `from hf_dp_repr.config import DPTrainingArguments`, or unpickling an object
saved under an old path) still works for one release: it warns `DeprecationWarning` naming the new path, and the
old name is the new module itself (`sys.modules` holds one module object under both names; monkeypatching either
patches both). The root package installs the finder (`install()`); nothing here is imported before it is needed.
Names a module served for another (`from hf_dp_repr.privacy.accounting import PrivacyLedger`) go through that
module's `__getattr__` and `moved_attribute`, with the same warning.

Example:
    >>> import sys, warnings
    >>> _ = sys.modules.pop("hf_dp_repr.model_card", None)  # warns on the first import of the old path only
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     import hf_dp_repr.model_card as old
    >>> import hf_dp_repr.hub.card as new
    >>> old is new, seen[0].category.__name__
    (True, 'DeprecationWarning')
    >>> print(seen[0].message)
    hf_dp_repr.model_card moved to hf_dp_repr.hub.card; import it from there (the old path goes in 0.3)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "hf_dp_repr.stdlib_corpus": "hf_dp_repr.data.stdlib_corpus",
    "hf_dp_repr.image_data": "hf_dp_repr.data.images",
    "hf_dp_repr.model_files": "hf_dp_repr.data.model_files",
    "hf_dp_repr.scope_groups": "hf_dp_repr.scope.groups",
    "hf_dp_repr.head_init": "hf_dp_repr.scope.head_init",
    "hf_dp_repr.lora": "hf_dp_repr.scope.lora",
    "hf_dp_repr.cached_head": "hf_dp_repr.scope.cached_head",
    "hf_dp_repr.prefix_cache": "hf_dp_repr.scope.prefix_cache",
    "hf_dp_repr.feature_store": "hf_dp_repr.scope.feature_store",
    "hf_dp_repr.model_card": "hf_dp_repr.hub.card",
    "hf_dp_repr.public_names": "hf_dp_repr.hub.public_names",
    "hf_dp_repr.trainer": "hf_dp_repr.training.trainer",
    "hf_dp_repr.config": "hf_dp_repr.training.arguments",
    "hf_dp_repr.config_checks": "hf_dp_repr.training.argument_checks",
    "hf_dp_repr.trainer_fields": "hf_dp_repr.training.argument_fields",
    "hf_dp_repr.plan": "hf_dp_repr.training.plan",
    "hf_dp_repr.resume": "hf_dp_repr.training.resume",
    "hf_dp_repr.checkpoint": "hf_dp_repr.training.checkpoint",
    "hf_dp_repr.output_dir": "hf_dp_repr.training.output_dir",
    "hf_dp_repr.continual": "hf_dp_repr.training.continual",
    "hf_dp_repr.curvature": "hf_dp_repr.training.curvature",
    "hf_dp_repr.eval_overlap": "hf_dp_repr.training.eval_overlap",
    "hf_dp_repr.data_checks": "hf_dp_repr.training.data_checks",
    "hf_dp_repr.tuning.seed000": "hf_dp_repr.scripts.seed000",
    "hf_dp_repr.tuning.tuning_data": "hf_dp_repr.training.tuning_data",
    "hf_dp_repr.privacy.budget_floor": "hf_dp_repr.privacy.accounting",
}
# Names a module served for another one (module, name) → the module that has them now; see `moved_attribute`.
MOVED_NAMES = {
    **{("hf_dp_repr.privacy.accounting", name): "hf_dp_repr.privacy.ledger"
       for name in ("LEDGER_FILE", "Phase", "PrivacyLedger", "PrivacyPlan")},
    # errors the modules that raised them re-exported, before errors.py held them all
    ("hf_dp_repr.scope", "ScopeError"): "hf_dp_repr.errors",
    ("hf_dp_repr.hub", "HubAccessError"): "hf_dp_repr.errors",
    ("hf_dp_repr.training.checkpoint", "CheckpointMismatchError"): "hf_dp_repr.errors",
    ("hf_dp_repr.privacy.validation", "NotPrivatizableError"): "hf_dp_repr.errors",
}
REMOVED_IN = "0.3"


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of `MOVED` (only when no file has that name) and loads it as the new module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in {REMOVED_IN})",
                      DeprecationWarning, stacklevel=2)  # the import statement: warn skips importlib's frames
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # The import system set the old path's spec on the (already executed) module: give it its own back.
        module.__spec__ = module.__spec__.loader_state


def moved_attribute(module: str, name: str):
    """For a module's `__getattr__`: `name` from the module that has it now (`MOVED_NAMES`), with a
    DeprecationWarning; AttributeError for any other name. Imports by name, at the first use only, so the old module
    needs no import of the new one (which may import it)."""
    new = MOVED_NAMES.get((module, name))
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} moved to {new}.{name}; import it from there (the old place goes in "
                  f"{REMOVED_IN})", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)


_FINDER = _MovedModuleFinder()


def install() -> None:
    """Put the finder at the end of `sys.meta_path`, once: the old paths resolve only when no module file has them."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
