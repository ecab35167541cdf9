"""`make demo`: the embedded default end to end, offline (the code: `hf_dp_repr/scripts/demo.py`).

    python recipes/demo.py [--output_dir demo_out]
"""

import os

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()  # before torch loads: OMP_WAIT_POLICY=PASSIVE, ... (hf_dp_repr/entry_point.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo never needs the Hub; before huggingface_hub reads it

from hf_dp_repr.scripts.runner import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("demo"))  # one runner: an argument error is one line, exit code 2
