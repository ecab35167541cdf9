"""Property tests (hypothesis): invariances of D and PR, and streaming == all-in-memory."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dp_repr.analysis import (
    ResidualStats,
    SeparationStats,
    prediction_residual,
    separation_fuzziness,
)

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def labelled_features(draw):
    """(x, labels, rng): K classes with random means, 2+ examples each, d dims, well-conditioned noise."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    k = draw(st.integers(2, 5))
    d = draw(st.integers(1, 8))
    sizes = [draw(st.integers(2, 15)) for _ in range(k)]
    labels = np.repeat(np.arange(k), sizes)
    x = draw(st.floats(0.5, 5.0)) * rng.normal(size=(k, d))[labels] + rng.normal(size=(len(labels), d))
    return x, labels, rng


def rotation(rng, d):
    q, r = np.linalg.qr(rng.normal(size=(d, d)))
    return q * np.sign(np.diag(r))


def well_conditioned(rng, d):
    """Invertible d × d with singular values in [0.1, 10]: condition number ≤ 100."""
    return rotation(rng, d) @ np.diag(rng.uniform(0.1, 10.0, d)) @ rotation(rng, d)


scales = st.floats(1e-3, 1e3)
offsets = st.floats(-1e3, 1e3)


@SETTINGS
@given(labelled_features(), scales, offsets)
def test_fuzziness_invariant_to_translation_scaling_rotation(data, scale, offset):
    x, labels, rng = data
    d = x.shape[1]
    moved = scale * x @ rotation(rng, d) + offset * rng.uniform(-1, 1, d)
    assert separation_fuzziness(moved, labels) == pytest.approx(separation_fuzziness(x, labels), rel=1e-7)


@SETTINGS
@given(labelled_features(), scales, offsets)
def test_residual_invariant_to_translation_scaling_rotation(data, scale, offset):
    x, labels, rng = data
    y = labels + rng.normal(size=len(labels))
    moved = scale * x @ rotation(rng, x.shape[1]) + offset
    assert prediction_residual(moved, y) == pytest.approx(prediction_residual(x, y), rel=1e-7, abs=1e-9)


@SETTINGS
@given(labelled_features(), offsets)
def test_residual_invariant_to_any_invertible_affine_map(data, offset):
    x, labels, rng = data
    d = x.shape[1]
    y = x @ rng.normal(size=d) + rng.normal(size=len(labels))
    mapped = x @ well_conditioned(rng, d) + offset * rng.uniform(-1, 1, d)
    assert prediction_residual(mapped, y) == pytest.approx(prediction_residual(x, y), rel=1e-7, abs=1e-9)
    one_hot = prediction_residual(x, labels, one_hot=True)
    assert prediction_residual(mapped, labels, one_hot=True) == pytest.approx(one_hot, rel=1e-7, abs=1e-9)


@SETTINGS
@given(labelled_features(), st.lists(st.integers(1, 10), min_size=1, max_size=8), st.floats(-1e4, 1e4))
def test_streaming_equals_all_in_memory(data, cuts, offset):
    x, labels, rng = data
    x = x + offset  # a large common offset must not cancel in the merge
    order = rng.permutation(len(labels))  # batches see classes in arbitrary order and mixtures
    x, labels = x[order], labels[order]
    y = labels + rng.normal(size=len(labels))
    sep, res = SeparationStats(), ResidualStats()
    bounds = np.cumsum([0, *cuts])
    bounds = [b for b in bounds if b < len(labels)] + [len(labels)]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        sep.update(x[start:stop], labels[start:stop])
        res.update(x[start:stop], y[start:stop])
    assert sep.num_examples == res.num_examples == len(labels)
    assert sep.fuzziness() == pytest.approx(separation_fuzziness(x, labels), rel=1e-8)
    assert res.residual() == pytest.approx(prediction_residual(x, y), rel=1e-8, abs=1e-10)


@SETTINGS
@given(labelled_features())
def test_fuzziness_matches_textbook_formula(data):
    """Streaming statistics agree with SS_w, SS_b written out directly from the definitions."""
    x, labels, _ = data
    n, classes = len(labels), np.unique(labels)
    grand = x.mean(0)
    ss_b = sum((labels == k).sum() * np.outer(x[labels == k].mean(0) - grand, x[labels == k].mean(0) - grand)
               for k in classes) / n
    ss_w = sum((x[labels == k] - x[labels == k].mean(0)).T @ (x[labels == k] - x[labels == k].mean(0))
               for k in classes) / n
    got_w, got_b = SeparationStats().update(x, labels).scatter_matrices()
    np.testing.assert_allclose(got_w.numpy(), ss_w, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(got_b.numpy(), ss_b, rtol=1e-9, atol=1e-10)
