"""The synthetic-text recipe (the code and its documentation: `hf_dp_repr/scripts/synth.py`; also `hf-dp-repr synth`).

    python recipes/dp_synthetic_text.py --help
    python recipes/dp_synthetic_text.py --config recipes/configs/synth_stdlib_topics_eps4.yaml
"""

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()  # before torch loads: OMP_WAIT_POLICY=PASSIVE, ... (hf_dp_repr/entry_point.py)

from hf_dp_repr.scripts.runner import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("synth"))  # one runner: an argument error is one line, exit code 2
