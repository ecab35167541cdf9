"""DP-SGD machinery: accounting, sampling, per-example clipping, noise; one run's, together, in `engine.DPEngine`.

Opacus' per-sample gradient rules for Hugging Face modules (`grad_samplers.HF_GRAD_SAMPLERS`) are registered here,
once, so that any import of the package has them before a model is hooked.
"""

from .grad_samplers import register_grad_samplers

register_grad_samplers()
