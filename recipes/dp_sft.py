"""The SFT recipe: DP LoRA SFT of a chat model with TRL (the code and its documentation: `hf_dp_repr/scripts/sft.py`;
also `hf-dp-repr train sft`).

    python recipes/dp_sft.py --help
    accelerate launch [--config_file recipes/accelerate_configs/cpu_2proc.yaml] recipes/dp_sft.py ARGS
"""

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()  # before torch loads: OMP_WAIT_POLICY=PASSIVE, ... (hf_dp_repr/entry_point.py)

from hf_dp_repr.scripts.runner import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("sft"))  # one runner: an argument error is one line, exit code 2
