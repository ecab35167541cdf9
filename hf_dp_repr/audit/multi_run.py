"""Classic privacy auditing over repeated runs (Jagielski et al. 2020; Nasr et al. 2021), for small models.

Train N times with one canary and N times without it, record the canary's loss each time, and threshold it:
"loss ≤ t" means "the canary was in". The threshold is chosen on separate calibration runs (choosing it on the
runs that are then counted would overstate the bound); the counted runs give TP of N and FP of N, and
`bounds.multi_run_epsilon_lower_bound` turns them into ε_lb with Clopper–Pearson intervals. It costs 2N (+
calibration) trainings, against one for `canaries.train_with_canaries`: use it to check the one-run bound on a
task small enough to train many times.

Example (losses of a canary in 4 runs with it and 4 without):
    >>> import numpy as np
    >>> best_threshold(np.array([0.1, 0.2, 0.3, 2.0]), np.array([1.5, 2.5, 3.0, 4.0]))
    0.9
    >>> out = audit_from_losses(np.array([0.1, 0.2, 0.1, 0.3]), np.array([2., 3., 2.5, 4.]), threshold=0.9, delta=0.)
    >>> out["tpr"], out["fpr"], out["epsilon_lower_bound"]   # perfect, but 4 + 4 runs prove nothing at 95 %
    (1.0, 0.0, 0.0)
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .bounds import multi_run_epsilon_lower_bound


def best_threshold(losses_in: np.ndarray, losses_out: np.ndarray) -> float:
    """The midpoint threshold that maximises TPR − FPR on calibration runs (ties: the first)."""
    values = np.unique(np.r_[losses_in, losses_out])
    candidates = np.r_[values[0] - 1, (values[:-1] + values[1:]) / 2, values[-1] + 1]
    gaps = [(np.mean(losses_in <= t) - np.mean(losses_out <= t), -i) for i, t in enumerate(candidates)]
    return float(candidates[-max(gaps)[1]])


def audit_from_losses(losses_in: np.ndarray, losses_out: np.ndarray, threshold: float, delta: float,
                      beta: float = 0.05) -> dict:
    """ε lower bound from the canary's loss in runs with it (`losses_in`) and without (`losses_out`)."""
    tp, fp = int(np.sum(losses_in <= threshold)), int(np.sum(losses_out <= threshold))
    out = multi_run_epsilon_lower_bound(tp, len(losses_in), fp, len(losses_out), delta, beta)
    out.update(threshold=threshold, runs_with=len(losses_in), runs_without=len(losses_out))
    return out


def multi_run_audit(train_and_score: Callable[[bool], float], runs: int, calibration_runs: int, delta: float,
                    beta: float = 0.05) -> dict:
    """Call `train_and_score(include_canary)` (one fresh training run → the canary's loss) for
    `calibration_runs` + `runs` runs each way; pick the threshold on the calibration runs, count on the rest."""
    from tqdm.auto import tqdm

    losses = {True: [], False: []}
    with tqdm(total=2 * (runs + calibration_runs), desc="audit runs") as bar:
        for _ in range(runs + calibration_runs):
            for include in (True, False):
                losses[include].append(train_and_score(include))
                bar.update()
    with_c, without_c = np.asarray(losses[True]), np.asarray(losses[False])
    threshold = best_threshold(with_c[:calibration_runs], without_c[:calibration_runs])
    return audit_from_losses(with_c[calibration_runs:], without_c[calibration_runs:], threshold, delta, beta)
