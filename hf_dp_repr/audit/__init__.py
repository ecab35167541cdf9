"""Privacy audit: evidence about a trained model beside the ε its ledger claims.

- `mia`: membership inference (loss threshold, difficulty-calibrated with reference models): ROC AUC, TPR at low
  FPR, log-log ROC plot; `hf-dp-repr audit` (`cli`) runs it on a saved run and writes a JSON report.
- `canaries`: Steinke, Nasr & Jagielski (2023): m canaries each included with probability 1/2 (a secret draw),
  one training run, guesses → an empirical lower bound on ε at a stated confidence; image canaries scored by loss.
- `dirac`: the same audit with white-box gradient canaries (each a gradient B·e_i, B ≫ C, read from the released
  updates): it measures the clipped update itself, so it sees clipping switched off, which image canaries miss.
  `hf-dp-repr audit canaries` (`canary_cli`) runs either from the command line.
- `bounds`: the one-run bound, Clopper–Pearson intervals and the classic multi-run bound.
- `multi_run`: the classic audit over repeated runs with and without one canary.
- `exposure`: canary exposure of a causal LM (Carlini et al. 2019): secret-bearing sentences inserted r times,
  exposure = log2 |R| − log2 rank of the secret (exact, or extrapolated by a skew-normal fit); `exposure_run` trains
  without and with DP side by side, `hf-dp-repr audit exposure` (`exposure_cli`) runs it (docs/exposure.md).

An empirical lower bound above the claimed ε means the implementation or the accounting is wrong; a bound below
it proves nothing about privacy (the attack may be weak). Every audit reads private training data outside DP-SGD:
its results are not covered by the DP guarantee and are never pushed by hf-dp-repr (see README, "Privacy audit").

Example:
    >>> from hf_dp_repr.audit import one_run_epsilon_lower_bound
    >>> one_run_epsilon_lower_bound(m=100, r=40, v=20, delta=1e-5)   # coin-flip guesses prove nothing
    0.0
"""

from .bounds import clopper_pearson, multi_run_epsilon_lower_bound, one_run_epsilon_lower_bound, one_run_p_value
from .canaries import draw_inclusion, make_canaries, one_run_audit, train_with_canaries
from .dirac import DiracCanaryTrainer, train_with_dirac_canaries
from .exposure import Canary, draw_canaries, exposure, exposures
from .mia import calibrated_scores, classification_losses, plot_roc, roc_metrics

__all__ = ["clopper_pearson", "multi_run_epsilon_lower_bound", "one_run_epsilon_lower_bound", "one_run_p_value",
           "draw_inclusion", "make_canaries", "one_run_audit", "train_with_canaries", "DiracCanaryTrainer",
           "train_with_dirac_canaries", "Canary", "draw_canaries", "exposure", "exposures", "calibrated_scores",
           "classification_losses", "plot_roc", "roc_metrics"]
