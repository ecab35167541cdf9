"""Smoke test of benchmarks/throughput.py: one run prints the side-by-side table for both model kinds, and one CPU
peak-memory process (what the table's memory columns run once per row) reports a peak."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _throughput(*flags: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), *flags], env=ENV,
                          capture_output=True, text=True, timeout=300, check=True).stdout


def test_quick_benchmark_prints_every_run_with_ratios():
    out = _throughput("--quick", "--no-memory")  # the 8 peak-memory processes: one of them is the next test
    for model in ("tiny-vit", "tiny-gpt2"):
        assert model in out
    rows = re.findall(r"^\| (Trainer \(non-private\)|DPTrainer ghost|DPTrainer hooks|Opacus hooks \(plain\))\s+\|"
                      r"\s+([\d.]+) \|\s+([\d.]+) \|\s+([\d.]+) – ([\d.]+) \|", out, flags=re.M)
    assert len(rows) == 8, out
    assert all(float(speed) > 0 for _, speed, *_ in rows)
    assert [float(ratio) for label, _, ratio, *_ in rows if label.startswith("Trainer")] == [1.0, 1.0]
    assert all(float(low) <= float(high) for *_, low, high in rows)  # the ratio's range over the rounds


def test_one_runs_peak_memory_in_a_process_of_its_own():
    """The child process `cpu_peak` starts for each row (same flags): DPTrainer's ghost run on the tiny GPT-2 holds
    memory above the RSS before the model is built."""
    out = _throughput("--models", "tiny-gpt2", "--memory-of", "DPTrainer ghost", "--steps", "1", "--warmup", "1")
    assert int(out.split("PEAK_BYTES ")[1].split()[0]) > 0, out


def test_realistic_sizes_prints_the_ratio_and_the_start_up_cost():
    """benchmarks/realistic_sizes.py on its smoke-test config (LoRA on a tiny GPT-2), one round, each contender in
    its own process: a row with both step times, their ratio and DP's start-up cost."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "realistic_sizes.py"), "--configs",
                          "tiny-gpt2-lora", "--rounds", "1", "--steps", "1", "--warmup", "1", "--no-memory"], env=ENV,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    row = re.search(r"^\| tiny-gpt2-lora \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|.*\| ([\d.]+) \| ([\d.]+) \| "
                    r"(-?[\d.]+) \|$", out, flags=re.M)
    assert row, out
    plain, dp, ratio, plain_start, dp_start, _ = map(float, row.groups())
    assert plain > 0 and dp > 0 and ratio > 0
    assert dp_start > 0 and plain_start > 0
