"""DP-SGD machinery: accounting, sampling, per-example clipping, noise; one run's, together, in `engine.DPEngine`.

Importing this package imports nothing heavy: `accountants` and `accounting` load without torch or transformers
(`hf-dp-repr privacy` and its tests rely on it). The per-example rules of the module families (`modules/`: one file
per family, each registering its per-sample rule for Opacus' hooks and its ghost rule for the ghost-norm engine)
register as `privacy.modules` loads, which also installs the per-sample rules into Opacus' own registry; every module
that hooks a model (`clippers`, `ghost_clipping`) imports it, so the rules are in place before a model is hooked
(tests/test_one_way.py checks it).
"""
