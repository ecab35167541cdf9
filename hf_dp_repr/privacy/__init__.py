"""DP-SGD machinery: accounting, sampling, per-example clipping, noise; one run's, together, in `engine.DPEngine`.

The per-example rules of the module families (`modules/`: per-sample rules for Opacus' hooks, ghost rules for the
ghost-norm engine) are registered here, once, so that any import of the package has them before a model is hooked.
"""

from . import modules  # noqa: F401 (registers each family's rules)
from .grad_samplers import register_grad_samplers

register_grad_samplers()
