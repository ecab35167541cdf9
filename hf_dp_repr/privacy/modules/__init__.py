"""The per-example rules of each module family, one file per family (Opacus' layout): each registers, for its
module types, the per-sample gradient rule (`grad_samplers.register_per_sample_rule`, for Opacus' hooks) and the
ghost-norm rule (`ghost_rules.register_ghost_rule`, for the ghost-clipping engine). Supporting a new architecture
touches one file here (or a user's own module with the same two registrations; docs/extending.md).

Imported by every module that hooks a model (`clippers`, `ghost_clipping`): it loads the families, then installs
their per-sample rules into Opacus (`register_grad_samplers`), once.
Registration order is the order ghost rules are tried (first match wins); the families' matchers do not overlap.
"""

from ..grad_samplers import register_grad_samplers
from . import conv, embedding, linear, norm  # noqa: F401 (each registers its rules)

register_grad_samplers()
