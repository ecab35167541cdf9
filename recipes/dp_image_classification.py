"""The image recipe (the code and its documentation: `hf_dp_repr/scripts/image_classification.py`; also `hf-dp-repr train image`).

    python recipes/dp_image_classification.py --help
    accelerate launch [--config_file recipes/accelerate_configs/cpu_2proc.yaml] recipes/dp_image_classification.py ARGS
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see hf_dp_repr/scripts/utils.py)

from hf_dp_repr.scripts.image_classification import main  # noqa: E402

if __name__ == "__main__":
    main()
