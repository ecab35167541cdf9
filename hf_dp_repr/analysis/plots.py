"""Figures: D_l and PR_l against layer on a log scale (as in seed 000), and an optional UMAP of features.

Drawn on `matplotlib.figure.Figure` objects, never pyplot, so nothing depends on (or changes) the backend and
no global figure state leaks between calls.

Example:
    >>> import tempfile, pathlib
    >>> from hf_dp_repr.analysis import RepresentationReport, fit_law, plot_laws
    >>> r = RepresentationReport("image-classification", "cls", 100, 100, residual=[0.9, 0.5, 0.3, 0.2],
    ...                          fuzziness=[9.0, 3.0, 1.0, 0.4], fuzziness_law=fit_law([9.0, 3.0, 1.0, 0.4]))
    >>> path = plot_laws({"step 0": r}, pathlib.Path(tempfile.mkdtemp()) / "law.png")
    >>> path.stat().st_size > 0
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..errors import ArgumentError, DataError
from .law_report import RepresentationReport

__all__ = ["plot_laws", "plot_umap"]


def plot_laws(curves: Mapping[str, RepresentationReport], path: str | Path, title: str | None = None) -> Path:
    """Save a PNG with log-scale D_l (if measured) and PR_l against layer, one line per entry of `curves`.

    `curves` maps a legend label (an evaluation step, a model name) to its report; the legend adds each
    law's ρ. Layers whose value is not positive (undefined on a log axis) are left out of the line.
    """
    if not curves:
        raise ArgumentError("`curves` is empty; pass at least one {label: RepresentationReport}")
    panels = [("residual", "prediction residual PR$_l$")]
    if any(r.fuzziness is not None for r in curves.values()):
        panels.insert(0, ("fuzziness", "separation fuzziness D$_l$"))
    fig = Figure(figsize=(5.0 * len(panels), 4.0), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, ylabel) in zip(axes, panels):
        for label, report in curves.items():
            values = getattr(report, name)
            if values is None:
                continue
            if name in report.unreliable:  # the analyzer calls it meaningless: no curve, a legend entry says why
                ax.plot([], [], linestyle="none", label=f"{label}: withheld (too few rows)")
                continue
            layers = [layer for layer, v in enumerate(values) if math.isfinite(v) and v > 0]
            law = getattr(report, f"{name}_law")
            legend = label if law is None else f"{label} (ρ={law.rho:.2f})"
            ax.plot(layers, [values[layer] for layer in layers], marker="o", label=legend)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer (0 = embedding output)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_umap(features: Any, labels: Any, path: str | Path, *, title: str | None = None, seed: int = 0,
              **umap_kwargs) -> Path:
    """Save a 2-D UMAP scatter of `features` (n × d, e.g. the penultimate layer) coloured by `labels`.

    Needs the optional dependency `umap-learn` (`pip install 'hf-dp-repr[umap]'`), imported only here.
    `umap_kwargs` go to `umap.UMAP` (e.g. n_neighbors=15, min_dist=0.1).
    """
    try:
        import umap
    except ImportError as err:
        raise ImportError("plot_umap needs the optional dependency `umap-learn`: "
                          "pip install 'hf-dp-repr[umap]' (or pip install umap-learn)") from err
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    if x.ndim != 2 or len(x) != len(y):
        raise DataError(f"`features` must be n × d and `labels` length n; got {x.shape} and {y.shape}")
    embedding = umap.UMAP(n_components=2, random_state=seed, **umap_kwargs).fit_transform(x)
    fig = Figure(figsize=(5.0, 5.0), layout="constrained")
    ax = fig.subplots()
    points = ax.scatter(embedding[:, 0], embedding[:, 1], c=y, cmap="tab10", s=6)
    ax.legend(*points.legend_elements(), title="class", fontsize="small", loc="best")
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title)
    return _save(fig, path)


def _save(fig: Figure, path: str | Path) -> Path:
    """Write `fig` to `path` (its folder made if missing) at the plots' resolution."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
