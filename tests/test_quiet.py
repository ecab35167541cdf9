"""A demo-sized run prints no warning that asks for no action (Opacus' RDP remark under prv, torch's full-backward-
hook and pin-memory lines, the bundled-metric fallback), while a warning that asks for action (δ ≥ 1/n) still shows."""

import logging
import warnings

from hf_dp_repr.quiet import FULL_BACKWARD_HOOK, PIN_MEMORY_ON_CPU, RDP_LARGEST_ALPHA
from hf_dp_repr.scripts import image_classification

NOISE = (FULL_BACKWARD_HOOK, PIN_MEMORY_ON_CPU, RDP_LARGEST_ALPHA, "evaluate.load(", "torchvision")


def _run(tmp_path, *extra):
    return image_classification.main([
        "--output_dir", str(tmp_path), "--target_epsilon", "1", "--accountant", "prv", "--public_fraction", "0.2",
        "--public_epochs", "1", "--per_device_train_batch_size", "64", "--max_steps", "2", "--max_eval_samples", "64",
        "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", *extra])


def test_a_demo_sized_run_prints_no_noise_but_keeps_warnings_that_ask_for_action(tmp_path, caplog, capfd):
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO):
        warnings.simplefilter("default")  # show every warning once, as a user's Python would
        from hf_dp_repr.quiet import silence_known_noise

        silence_known_noise()
        metrics = _run(tmp_path / "quiet", "--target_delta", "1e-4")
        quiet = [str(w.message) for w in seen]
        warned_logs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        seen.clear()
        _run(tmp_path / "delta", "--target_delta", "0.01", "--allow_large_delta", "true")  # ≥ 1/n: ~1150 digits
        loud = [str(w.message) for w in seen]
    printed = capfd.readouterr()
    assert 0 < metrics["epsilon"] <= 1
    for text in NOISE:
        assert not [m for m in quiet + warned_logs if text in m], text
        assert text not in printed.out + printed.err, text
    assert any("is >= 1/n" in m and "Allowed by allow_large_delta=True" in m for m in loud), loud


def test_plan_and_engine_are_info_lines_shown_by_log_level_info_and_no_deprecation_noise(digits, tmp_path, caplog):
    """Routine lines (the DP plan, the clipping engine) are INFO, not WARNING; `log_level="info"` shows them as the
    Trainer shows its own INFO lines; transformers' `is_gradient_checkpointing` FutureWarning is not triggered."""
    from transformers.utils import logging as hf_logging

    from hf_dp_repr import DPTrainer, DPTrainingArguments
    from hf_dp_repr.tiny import tiny_vit

    library = logging.getLogger("hf_dp_repr")
    before, hf_before = library.level, hf_logging.get_verbosity()
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=8.0, target_delta=1e-4, max_steps=2,
                               per_device_train_batch_size=32, trainable_blocks=2, lp_steps=0.5, accountant="rdp",
                               report_to="none", save_strategy="no", disable_tqdm=True, log_level="info")
    try:
        with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO):
            warnings.simplefilter("default")
            trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"].select(range(128)))
            assert library.getEffectiveLevel() == logging.INFO
            trainer.train()
    finally:  # the Trainer set transformers' verbosity from log_level too
        library.setLevel(before)
        hf_logging.set_verbosity(hf_before)
    routine = ("DP-SGD plan (", "clipping_engine=", "DP-SGD phase 'fine_tune' starts")
    for text in routine:
        levels = {r.levelno for r in caplog.records if text in r.getMessage()}
        assert levels == {logging.INFO}, (text, levels)
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)]


def test_rdp_accountant_prints_no_largest_alpha_remark():
    from hf_dp_repr.privacy.accounting import compute_epsilon

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        eps = compute_epsilon([(20.0, 0.04, 3)], 1e-4, "rdp")  # large σ: Opacus' largest order is the best one
    assert 0 < eps < 0.1 and not [w for w in seen if RDP_LARGEST_ALPHA in str(w.message)]
