"""Smoke test of benchmarks/throughput.py: one run prints the side-by-side table for both model kinds."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_prints_every_run_with_ratios():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick"], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    for model in ("tiny-vit", "tiny-gpt2"):
        assert model in out
    rows = re.findall(r"^\| (Trainer \(non-private\)|DPTrainer ghost|DPTrainer hooks|Opacus hooks \(plain\))\s+\|"
                      r"\s+([\d.]+) \|\s+([\d.]+) \|\s+([\d.]+) – ([\d.]+) \|", out, flags=re.M)
    assert len(rows) == 8, out
    assert all(float(speed) > 0 for _, speed, *_ in rows)
    assert [float(ratio) for label, _, ratio, *_ in rows if label.startswith("Trainer")] == [1.0, 1.0]
    assert all(float(low) <= float(high) for *_, low, high in rows)  # the ratio's range over the rounds
