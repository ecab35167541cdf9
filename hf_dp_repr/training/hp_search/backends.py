"""What runs `DPTrainer.hyperparameter_search`: search backends registered by name, so that the trainer imports
nothing of the stages that search with it (`hf_dp_repr.tuning`, or a user's own). The root package registers
tuning's Optuna search as "optuna", by reference: it is imported at its first use, and `import hf_dp_repr` stays
light. A backend is called as `backend(trainer, hp_space, compute_objective, n_trials, direction, hp_name, **kw)`;
while it runs trials it may append to `trainer.run_hooks` (each called as `hook(trainer, "complete" | "failed")`
when a `train()` ends).

Example:
    >>> def grid(trainer, hp_space=None, *args, **kwargs): ...
    >>> register_search_backend("grid", grid)
    >>> search_backend("grid") is grid, "optuna" in SEARCH_BACKENDS
    (True, True)
    >>> del SEARCH_BACKENDS["grid"]
"""

from __future__ import annotations

import importlib
from typing import Callable

from ...errors import DPConfigError
from ...registry import Registry

# name → the backend, or "module:function" until its first use
SEARCH_BACKENDS = Registry("search backend", DPConfigError)


def register_search_backend(name: str, backend: Callable | str, *, replace: bool = False) -> None:
    """Make `backend` (a callable, or "module:function" imported at its first use) the search run for `name`."""
    SEARCH_BACKENDS.add(name, backend, replace=replace)


def search_backend(name: str) -> Callable:
    """The backend registered as `name`; a DPConfigError (a ValueError) naming the registered ones otherwise."""
    backend = SEARCH_BACKENDS.get(name)
    if backend is None:
        raise DPConfigError(f"DPTrainer.hyperparameter_search: backend={name!r}; the backends that run a search under "
                            f"DP (each trial's privacy plan is set up through them) are {sorted(SEARCH_BACKENDS)}.")
    if isinstance(backend, str):
        module, _, function = backend.partition(":")
        backend = SEARCH_BACKENDS[name] = getattr(importlib.import_module(module), function)
    return backend
