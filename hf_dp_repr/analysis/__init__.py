"""Representation analyzers: what (DP) fine-tuning does to the features of every layer.

- `separation_fuzziness` — D = Tr(SS_w · SS_b⁺) of one layer (He & Su 2023; seed 000 prints it inverted).
- `prediction_residual` — PR = RSS / TSS of a least-squares fit from features to a target (He & Su 2024).
- `fit_law` — ρ, intercept and Pearson r of log(value) against layer (D_l ≈ ρ^l D_0, PR_l ≈ ρ^(l−1) PR_1).
- `analyze_representations` — D_l and PR_l at every hidden state of a 🤗 model, streamed in O(layers · d²).
- `RepresentationLawCallback` — the same during `Trainer.train()`, logged as `repr/...` + JSON + PNG.
- `linear_cka`, `layer_cka` — how far a layer's features moved from a reference model's.
- `knn_probe`, `extract_features`, `plot_laws`, `plot_umap` — probes and figures.

Example:
    >>> import numpy as np
    >>> from hf_dp_repr.analysis import separation_fuzziness, prediction_residual, fit_law
    >>> rng = np.random.default_rng(0)
    >>> y = rng.integers(0, 3, 300)
    >>> layers = [np.eye(3)[y] * s + rng.normal(size=(300, 3)) for s in (1, 2, 4, 8)]
    >>> d = [separation_fuzziness(x, y) for x in layers]
    >>> fit_law(d).rho < 1 and prediction_residual(layers[-1], y) < prediction_residual(layers[0], y)
    True
"""

from .callback import RepresentationLawCallback
from .features import analyze_representations, extract_features
from .knn import knn_predict, knn_probe
from .law import LawFit, fit_law, fuzziness_law, residual_law
from .law_report import RepresentationReport
from .plots import plot_laws, plot_umap
from .residual import ResidualStats, next_token_codes, prediction_residual
from .separation import SeparationStats, separation_fuzziness
from .similarity import layer_cka, linear_cka

__all__ = [
    "LawFit",
    "RepresentationLawCallback",
    "RepresentationReport",
    "ResidualStats",
    "SeparationStats",
    "analyze_representations",
    "extract_features",
    "fit_law",
    "fuzziness_law",
    "knn_predict",
    "knn_probe",
    "layer_cka",
    "linear_cka",
    "next_token_codes",
    "plot_laws",
    "plot_umap",
    "prediction_residual",
    "residual_law",
    "separation_fuzziness",
]
