"""The lm recipe (the code and its documentation: `hf_dp_repr/scripts/causal_lm.py`; also `hf-dp-repr train lm`).

    python recipes/dp_causal_lm.py --help
    accelerate launch [--config_file recipes/accelerate_configs/cpu_2proc.yaml] recipes/dp_causal_lm.py ARGS
"""

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()  # before torch loads: OMP_WAIT_POLICY=PASSIVE, ... (hf_dp_repr/entry_point.py)

from hf_dp_repr.scripts.runner import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("causal_lm"))  # one runner: an argument error is one line, exit code 2
