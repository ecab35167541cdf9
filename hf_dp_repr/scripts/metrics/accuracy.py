"""Accuracy as an `evaluate` metric script, for machines that cannot fetch `evaluate.load("accuracy")` from the Hub.

The recipes try `evaluate.load("accuracy")` first and fall back to `evaluate.load(<this file>)`, the same
`evaluate` API on a local script. Accuracy = (1/n) Σ 1[prediction_i == reference_i].
"""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to their references.",
            citation="",
            inputs_description="predictions: list of int; references: list of int",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean())}
