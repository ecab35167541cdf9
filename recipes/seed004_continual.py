"""Seed 004's comparison (the code and its documentation: `hf_dp_repr/scripts/seed004_continual.py`).

    python recipes/seed004_continual.py --output_dir out/seed004 --target_epsilon 8 --max_steps 40 \
        --public_max_steps 60
"""

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()  # before torch loads: OMP_WAIT_POLICY=PASSIVE, ... (hf_dp_repr/entry_point.py)

from hf_dp_repr.scripts.runner import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("seed004_continual"))  # one runner: an argument error is one line, exit code 2
