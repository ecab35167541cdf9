"""The DPO recipe: DP preference optimisation after DP SFT, with TRL (the code and its documentation:
`hf_dp_repr/scripts/dpo.py`).

    python recipes/dp_dpo.py --help
    python recipes/dp_sft.py --config recipes/configs/dp_sft_tiny_llama.yaml --output_dir out/sft
    python recipes/dp_dpo.py --config recipes/configs/dp_dpo_tiny_llama.yaml --sft_model out/sft --output_dir out/dpo
"""

from hf_dp_repr.entry_point import prepare_entry_point

prepare_entry_point()  # before torch loads: OMP_WAIT_POLICY=PASSIVE, ... (hf_dp_repr/entry_point.py)

from hf_dp_repr.scripts.runner import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("dpo"))  # one runner: an argument error is one line, exit code 2
