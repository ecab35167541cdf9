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
        _run(tmp_path / "delta", "--target_delta", "0.01")  # 0.01 ≥ 1/n for the ~1150 private digits
        loud = [str(w.message) for w in seen]
    printed = capfd.readouterr()
    assert 0 < metrics["epsilon"] <= 1
    for text in NOISE:
        assert not [m for m in quiet + warned_logs if text in m], text
        assert text not in printed.out + printed.err, text
    assert any("is >= 1/n" in m and "Use δ < 1/n" in m for m in loud), loud
    assert any("bundled accuracy.py" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
