"""Seed 004's comparison (the code and its documentation: `hf_dp_repr/scripts/seed004_continual.py`).

    python recipes/seed004_continual.py --output_dir out/seed004 --target_epsilon 8 --max_steps 40 \
        --public_max_steps 60
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see hf_dp_repr/scripts/utils.py)

from hf_dp_repr.scripts.seed004_continual import main  # noqa: E402

if __name__ == "__main__":
    main()
