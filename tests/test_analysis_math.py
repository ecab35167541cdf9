"""Separation fuzziness, prediction residual, law fit and kNN probe on data with known answers."""

import numpy as np
import pytest
import torch

from hf_dp_repr.analysis import (
    ResidualStats,
    SeparationStats,
    fit_law,
    fuzziness_law,
    knn_predict,
    knn_probe,
    next_token_codes,
    prediction_residual,
    residual_law,
    separation_fuzziness,
)


def exact_classes(means, cov):
    """Points m_k ± sqrt(d)·L_j (L = chol(cov)): each class has mean exactly m_k and covariance exactly cov."""
    d = cov.shape[0]
    spread = np.sqrt(d) * np.linalg.cholesky(cov).T  # rows are sqrt(d)·L_j
    x = np.concatenate([np.concatenate([m + spread, m - spread]) for m in means])
    y = np.repeat(np.arange(len(means)), 2 * d)
    return x, y


def random_spd(rng, d):
    a = rng.normal(size=(d, d))
    return a @ a.T + 0.5 * np.eye(d)


# --- separation fuzziness ---------------------------------------------------------------------------------
def test_two_classes_closed_form():
    # SS_w = Σ, SS_b = μμᵀ for means ±μ, so D = Tr(Σ (μμᵀ)⁺) = μᵀΣμ / |μ|⁴.
    rng = np.random.default_rng(0)
    cov, mu = random_spd(rng, 5), rng.normal(size=5)
    x, y = exact_classes([mu, -mu], cov)
    assert separation_fuzziness(x, y) == pytest.approx(mu @ cov @ mu / (mu @ mu) ** 2, rel=1e-10)


def test_orthogonal_means_closed_form():
    # Means c_k·e_k, equal class sizes, isotropic SS_w = s²I: D = s²·Tr(SS_b⁺), and SS_b lives in the span
    # of e_0..e_{K−1}, so its K − 1 non-zero eigenvalues come from a K × K block.
    K, d, s = 3, 6, 0.7
    c = np.array([1.0, 2.0, 3.0])
    means = [c[k] * np.eye(d)[k] for k in range(K)]
    x, y = exact_classes(means, s**2 * np.eye(d))
    centred = np.diag(c) - c / K  # rows: m_k − m̄ in the first K coordinates
    ss_b = centred.T @ centred / K
    evals = np.linalg.eigvalsh(ss_b)
    expected = s**2 * np.sum(1 / evals[evals > 1e-9])  # rank K−1 = 2
    assert separation_fuzziness(x, y) == pytest.approx(expected, rel=1e-10)


def test_matches_float64_reference_in_high_dimension():
    rng = np.random.default_rng(1)
    K, d, n = 10, 256, 2000
    y = rng.integers(0, K, n)
    x = 3 * rng.normal(size=(K, d))[y] + rng.normal(size=(n, d)) + 50.0  # large common offset
    means = np.stack([x[y == k].mean(0) for k in range(K)])
    w = np.bincount(y) / n
    m = np.sqrt(w)[:, None] * (means - w @ means)
    ss_b = m.T @ m
    ss_w = sum(((x[y == k] - means[k]).T @ (x[y == k] - means[k])) for k in range(K)) / n
    reference = np.trace(ss_w @ np.linalg.pinv(ss_b, rcond=1e-10, hermitian=True))
    assert separation_fuzziness(x, y) == pytest.approx(reference, rel=1e-8)
    stats_w, stats_b = SeparationStats().update(x, y).scatter_matrices()
    np.testing.assert_allclose(stats_w.numpy(), ss_w, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(stats_b.numpy(), ss_b, rtol=1e-9, atol=1e-12)


def test_better_separated_is_smaller_and_labels_can_be_any_integers():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 4, 400)
    noise = rng.normal(size=(400, 4))
    tight, loose = 8 * np.eye(4)[y] + noise, 1 * np.eye(4)[y] + noise
    assert separation_fuzziness(tight, y) < separation_fuzziness(loose, y)
    relabelled = np.array([7, -3, 100, 42])[y]
    assert separation_fuzziness(tight, relabelled) == pytest.approx(separation_fuzziness(tight, y), rel=1e-12)


def test_accepts_torch_tensors():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(50, 3)), np.arange(50) % 2
    assert separation_fuzziness(torch.tensor(x), torch.tensor(y)) == pytest.approx(separation_fuzziness(x, y))


@pytest.mark.parametrize(
    "features, labels, match",
    [
        (np.ones((4, 2)), [0, 0, 0, 0], "at least 2 classes"),
        (np.ones((4, 2)), [0, 1, 0], "4 rows but `labels` has 3"),
        (np.array([[0.0, np.nan], [1, 1], [2, 2]]), [0, 1, 1], "non-finite"),
        (np.ones(4), [0, 1, 0, 1], "must be 2-D"),
        (np.ones((4, 2)), [0.5, 1, 0, 1], "integer class ids"),
        (np.ones((4, 2)), [0, 1, 0, 1], "class means .* coincide"),
    ],
)
def test_separation_errors_name_the_argument(features, labels, match):
    with pytest.raises(ValueError, match=match):
        separation_fuzziness(features, labels)


def test_float32_features_in_a_low_dim_subspace_ignore_their_rounding_noise():
    # 5 classes whose features span only 2 of 16 dims (rank of SS_b is 2 < K − 1). In exact arithmetic D and
    # PR equal those of the 2-d coordinates; float32 rounding adds tiny spread in the other 14 dims, which a
    # float64-precision cut-off would count as (hugely fuzzy / spuriously predictive) directions.
    rng = np.random.default_rng(9)
    y = np.repeat(np.arange(5), 12)
    z = 2 * rng.normal(size=(5, 2))[y] + rng.normal(size=(60, 2))
    x32 = (z @ rng.normal(size=(2, 16)) + 3.0).astype(np.float32)
    assert separation_fuzziness(x32, y) == pytest.approx(separation_fuzziness(z, y), rel=1e-4)
    target = z[:, 0] + rng.normal(size=60)
    assert prediction_residual(x32, target) == pytest.approx(prediction_residual(z, target), rel=1e-4)


# --- prediction residual ----------------------------------------------------------------------------------
def lstsq_residual(x, y):
    design = np.c_[x, np.ones(len(x))]
    fit = design @ np.linalg.lstsq(design, y, rcond=None)[0]
    return np.sum((y - fit) ** 2) / np.sum((y - y.mean(0)) ** 2)


def test_single_feature_is_one_minus_squared_correlation():
    rng = np.random.default_rng(4)
    x = rng.normal(size=300)
    y = 2 * x + rng.normal(size=300)
    assert prediction_residual(x[:, None], y) == pytest.approx(1 - np.corrcoef(x, y)[0, 1] ** 2, rel=1e-10)


def test_exact_and_useless_fits():
    x = np.arange(10.0)[:, None]
    assert prediction_residual(x, 3 * x[:, 0] - 2) == pytest.approx(0.0, abs=1e-12)
    assert prediction_residual(x, (x[:, 0] - 4.5) ** 2) == pytest.approx(1.0, abs=1e-12)  # symmetric: no slope


def test_matches_lstsq_with_collinear_and_constant_features():
    rng = np.random.default_rng(5)
    z = rng.normal(size=(200, 6))
    ln = z - z.mean(1, keepdims=True)  # LayerNorm-like: rows sum to zero, rank d − 1
    x = np.c_[ln, np.full(200, 3.0), 2 * ln[:, :1]]  # plus a constant and a duplicated direction
    y = z[:, 0] - z[:, 3] + 0.5 * rng.normal(size=200)
    assert prediction_residual(x, y) == pytest.approx(lstsq_residual(x, y), rel=1e-9)


def test_multi_output_and_one_hot():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(300, 4))
    labels = (x[:, 0] > 0).astype(int) + 2 * (x[:, 1] > 0.5)
    one_hot = np.eye(4)[labels]
    assert prediction_residual(x, labels, one_hot=True) == pytest.approx(lstsq_residual(x, one_hot), rel=1e-10)
    assert prediction_residual(x, one_hot) == pytest.approx(lstsq_residual(x, one_hot), rel=1e-10)
    # Class ids are only names under one-hot regression.
    renamed = np.array([9, 4, 0, 2])[labels]
    assert prediction_residual(x, renamed, one_hot=True) == pytest.approx(
        prediction_residual(x, labels, one_hot=True), rel=1e-12)


def test_more_dims_than_examples_fits_perfectly():
    rng = np.random.default_rng(7)
    assert prediction_residual(rng.normal(size=(10, 20)), rng.normal(size=10)) == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize(
    "features, targets, match",
    [
        (np.ones((3, 2)), [1.0, 2.0], "3 rows but `targets` has 2"),
        (np.array([[1.0], [np.inf], [2.0]]), [1.0, 2.0, 3.0], "non-finite"),
        (np.array([[1.0], [2.0], [3.0]]), [1.0, np.nan, 3.0], "non-finite"),
        (np.array([[1.0], [2.0], [3.0]]), [5.0, 5.0, 5.0], "constant"),
    ],
)
def test_residual_errors_name_the_argument(features, targets, match):
    with pytest.raises(ValueError, match=match):
        prediction_residual(features, targets)


def test_one_hot_stats_reject_out_of_range_class():
    with pytest.raises(ValueError, match=r"class ids in \[0, 3\)"):
        ResidualStats(num_classes=3).update(np.ones((2, 2)), [0, 3])


@pytest.mark.parametrize("signal", [0.0, 1.0, 3.0])
def test_next_token_sketch_estimates_the_one_hot_residual_of_a_large_vocabulary(signal):
    """3,000 token ids with Zipf frequencies (as text); the features see the next token's rank through a random
    map, more or less loudly. The 256-column sketch's PR is the exact 3,000-column one-hot PR to within 0.02."""
    rng = np.random.default_rng(11)
    vocab, n, d = 3000, 6000, 24
    weights = 1.0 / np.arange(1, vocab + 1)
    ids = rng.choice(vocab, size=n, p=weights / weights.sum())
    x = signal * rng.normal(size=(vocab, d))[ids] + rng.normal(size=(n, d))
    exact = ResidualStats(num_classes=vocab).update(x, ids).residual()
    sketch = ResidualStats(class_codes=next_token_codes(vocab)).update(x, ids).residual()
    assert next_token_codes(vocab).shape == (vocab, 256)
    assert sketch == pytest.approx(exact, abs=0.02)
    assert exact < 0.99 if signal else exact > 0.99


# --- law fit ----------------------------------------------------------------------------------------------
def test_law_recovers_geometric_decay():
    values = [5.0 * 0.6**layer for layer in range(7)]
    fit = fit_law(values)
    assert fit.rho == pytest.approx(0.6, rel=1e-12)
    assert fit.intercept == pytest.approx(np.log(5.0), rel=1e-12)
    assert fit.r == pytest.approx(-1.0, abs=1e-12)
    assert fit.layers == tuple(range(7))
    assert fit.predict(3) == pytest.approx(values[3], rel=1e-12)


def test_law_on_chosen_layers_and_mapping():
    values = [100.0, 1.0, 0.5, 0.25, 0.125]
    fit = fit_law(values, layers=[1, 2, 3, 4])
    assert fit.rho == pytest.approx(0.5) and fit.layers == (1, 2, 3, 4)
    assert fit_law({2: 4.0, 5: 0.5}).rho == pytest.approx(0.5)
    assert np.isnan(fit_law([2.0, 2.0, 2.0]).r)  # no variation: correlation undefined


def test_law_pearson_r_matches_numpy_on_noisy_values():
    values = [3.0, 2.5, 1.1, 0.9, 0.3]
    assert fit_law(values).r == pytest.approx(np.corrcoef(np.arange(5), np.log(values))[0, 1], rel=1e-12)


def test_default_laws_include_or_exclude_the_embedding_output():
    values = [50.0, 8.0, 4.0, 2.0]
    assert fuzziness_law(values).layers == (0, 1, 2, 3)
    assert residual_law(values).layers == (1, 2, 3) and residual_law(values).rho == pytest.approx(0.5)
    with pytest.warns(UserWarning, match=r"layers \[2\]"):
        assert fuzziness_law([4.0, 2.0, float("nan"), 0.5]).layers == (0, 1, 3)


@pytest.mark.parametrize("values, layers, match", [
    ([1.0], None, "at least 2"),
    ([1.0, 0.0, 2.0], None, r"positive and finite; layers \[1\]"),
    ([1.0, 2.0], [0, 5], r"`layers` \[5\]"),
])
def test_law_errors(values, layers, match):
    with pytest.raises(ValueError, match=match):
        fit_law(values, layers)


# --- kNN probe --------------------------------------------------------------------------------------------
def test_knn_weighted_vote_by_hand():
    # Query (1, 0). Class 0: one neighbour at angle 0 (cos 1). Class 1: three at angle 0.6 (cos 0.825),
    # of different norms (normalised away). With T = 0.07: exp(1/T) ≈ 1.6e6 beats 3·exp(0.825/T) ≈ 4e5.
    # With T huge every weight is ≈ 1, the vote is a count, and the majority (class 1) wins.
    near = [np.cos(0.6), np.sin(0.6)]
    memory = np.array([[2.0, 0.0], near, np.multiply(near, 3), np.multiply(near, 0.5), [-1.0, 0.0]])
    labels = [0, 1, 1, 1, 0]
    assert knn_predict(memory, labels, [[1.0, 0.0]], k=4).tolist() == [0]
    assert knn_predict(memory, labels, [[1.0, 0.0]], k=4, temperature=1e9).tolist() == [1]
    # k = 1 and k larger than the memory (capped at 5): the far class-0 point adds a tiny vote only.
    assert knn_predict(memory, labels, [[0.5, 1.0]], k=1).tolist() == [1]
    assert knn_predict(memory, labels, [[1.0, 0.0]], k=50).tolist() == [0]


def test_knn_matches_brute_force_reference():
    rng = np.random.default_rng(8)
    mem, mem_y = rng.normal(size=(200, 16)), rng.integers(0, 5, 200)
    query = rng.normal(size=(50, 16))
    unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)  # noqa: E731
    sims = unit(query) @ unit(mem).T
    expected = []
    for row in sims:
        top = np.argsort(-row)[:20]
        votes = np.zeros(5)
        np.add.at(votes, mem_y[top], np.exp(row[top] / 0.07))
        expected.append(votes.argmax())
    got = knn_predict(mem, mem_y, query, chunk_size=7)
    assert got.tolist() == expected
    assert knn_probe(mem, mem_y, query, expected) == 1.0


def test_knn_errors():
    with pytest.raises(ValueError, match="extract both from the same layer"):
        knn_probe(np.ones((3, 2)), [0, 1, 0], np.ones((1, 3)), [0])
    with pytest.raises(ValueError, match="`k` must be"):
        knn_probe(np.ones((3, 2)), [0, 1, 0], np.ones((1, 2)), [0], k=0)


def test_linear_cka_is_one_up_to_rotation_and_scale_and_low_for_unrelated_features():
    from hf_dp_repr.analysis import linear_cka

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 6))
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    assert linear_cka(x, 2.5 * x @ q + 7.0) == pytest.approx(1.0, abs=1e-12)  # rotation, scale and shift
    assert linear_cka(x, rng.normal(size=(300, 6))) < 0.1
    # one-dimensional features: CKA is the squared correlation
    a, b = rng.normal(size=300), rng.normal(size=300)
    y = a + 0.5 * b
    assert linear_cka(a[:, None], y[:, None]) == pytest.approx(np.corrcoef(a, y)[0, 1] ** 2, rel=1e-10)
    with pytest.raises(ValueError, match="same rows"):
        linear_cka(x, x[:10])
