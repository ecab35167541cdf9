"""DP-SGD machinery: accounting, sampling, per-example clipping, noise; one run's, together, in `engine.DPEngine`.

Importing this package imports nothing heavy: `accountants` and `accounting` load without torch or transformers
(`hf-dp-repr privacy` and its tests rely on it). Opacus' per-sample gradient rules for Hugging Face modules
(`grad_samplers.HF_GRAD_SAMPLERS`) register as `grad_samplers` loads, the way Opacus' own rules do; every module
that hooks a model with Opacus (`clippers`, `ghost_rules`) imports it, so the rules are
in place before a model is hooked (tests/test_one_way.py checks it).
"""
