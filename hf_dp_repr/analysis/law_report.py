"""`RepresentationReport`: per-layer D_l and PR_l of one model on one dataset, with their law fits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .law import LawFit

__all__ = ["RepresentationReport"]


@dataclass
class RepresentationReport:
    """What `analyze_representations` measured. Index l = `hidden_states[l]` (0 = embedding output).

    Attributes:
        task: "image-classification", "causal-lm" or "text-classification" (an encoder on labelled text).
        pooling: "cls" or "mean" (images, text classification); "tokens" (causal-lm: every non-padding position
            with a next token).
        num_examples: sequences or images seen.
        num_positions: rows fed to the statistics (= num_examples for vision, predicted tokens for language).
        fuzziness: D_l per layer (labelled tasks; None for causal-lm, whose "classes" would be the vocabulary).
        residual: PR_l per layer.
        fuzziness_law: fit over layers 0..L; residual_law: fit over layers 1..L (see `law.py`).
        notes: how particular layers were read (e.g. layer 0 under [CLS] pooling).
        unreliable: the measures the analyzer itself calls meaningless ("residual" with no more rows than feature
            dims + 1: an exact fit), with the reason. Their values stay in `to_dict()` with `"reliable": false`;
            `metrics()` and the `hf-dp-repr analyze` table withhold them.
    """

    task: str
    pooling: str
    num_examples: int
    num_positions: int
    residual: list[float]
    fuzziness: list[float] | None = None
    fuzziness_law: LawFit | None = None
    residual_law: LawFit | None = None
    notes: list[str] = field(default_factory=list)
    unreliable: dict[str, str] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        """Number of hidden states analysed (blocks + 1 for the embedding output)."""
        return len(self.residual)

    def to_dict(self) -> dict:
        """JSON-ready dict (NaN becomes None)."""
        return {
            "task": self.task,
            "pooling": self.pooling,
            "num_examples": self.num_examples,
            "num_positions": self.num_positions,
            "fuzziness": _clean(self.fuzziness),
            "residual": _clean(self.residual),
            "fuzziness_law": _clean_law(self.fuzziness_law, self.unreliable.get("fuzziness")),
            "residual_law": _clean_law(self.residual_law, self.unreliable.get("residual")),
            "notes": list(self.notes),
            "unreliable": dict(self.unreliable),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "RepresentationReport":
        def law(d):
            return None if d is None else LawFit(d["rho"], d["intercept"], _nan(d["r"]), tuple(d["layers"]))

        return cls(
            task=data["task"],
            pooling=data["pooling"],
            num_examples=data["num_examples"],
            num_positions=data["num_positions"],
            residual=[_nan(v) for v in data["residual"]],
            fuzziness=None if data["fuzziness"] is None else [_nan(v) for v in data["fuzziness"]],
            fuzziness_law=law(data["fuzziness_law"]),
            residual_law=law(data["residual_law"]),
            notes=list(data.get("notes", [])),
            unreliable=dict(data.get("unreliable", {})),
        )

    def metrics(self, prefix: str = "repr/") -> dict[str, float]:
        """Flat scalar metrics for a tracker: `{prefix}fuzziness/layer_03`, `{prefix}residual/rho`, ..."""
        out: dict[str, float] = {}
        width = max(2, len(str(self.num_layers - 1)))  # zero-padded so trackers sort layers correctly
        for name, values, law in (
            ("fuzziness", self.fuzziness, self.fuzziness_law),
            ("residual", self.residual, self.residual_law),
        ):
            if values is None or name in self.unreliable:  # withheld: trackers would plot it unflagged
                continue
            for layer, value in enumerate(values):
                out[f"{prefix}{name}/layer_{layer:0{width}d}"] = float(value)
            if law is not None:
                out[f"{prefix}{name}/rho"] = law.rho
                out[f"{prefix}{name}/r"] = law.r
        return out


def _nan(v):
    return float("nan") if v is None else float(v)


def _clean(values):
    return None if values is None else [None if not math.isfinite(v) else float(v) for v in values]


def _clean_law(law: LawFit | None, unreliable: str | None = None):
    if law is None:
        return None
    d = law.to_dict()
    d["r"] = None if not math.isfinite(d["r"]) else d["r"]
    d["reliable"] = unreliable is None
    if unreliable is not None:
        d["unreliable_reason"] = unreliable
    return d
