"""The text recipe (the code and its documentation: `hf_dp_repr/scripts/text_classification.py`; also
`hf-dp-repr train text`).

    python recipes/dp_text_classification.py --help
    accelerate launch [--config_file recipes/accelerate_configs/cpu_2proc.yaml] recipes/dp_text_classification.py ARGS
"""

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()  # before torch loads: OMP_WAIT_POLICY=PASSIVE, ... (hf_dp_repr/entry_point.py)

from hf_dp_repr.scripts.runner import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("text_classification"))  # one runner: an argument error is one line, exit code 2
