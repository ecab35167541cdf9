"""Analyzers on tiny 🤗 models: streaming equals in-memory, the law on a trained ViT, language positions."""

import numpy as np
import pytest
import torch

from hf_dp_repr.analysis import (
    analyze_representations,
    extract_features,
    knn_probe,
    prediction_residual,
    separation_fuzziness,
)
from hf_dp_repr.data import byte_tokenize, load_digits_dataset, load_stdlib_blocks, stdlib_text
from hf_dp_repr.tiny import tiny_gpt2, tiny_vit


@pytest.fixture(scope="module")
def digits_ds():
    return load_digits_dataset()


@pytest.fixture(scope="module")
def trained_vit(digits_ds):
    """Tiny ViT trained without DP on digits: a short AdamW loop, ~200 steps (a few seconds on 2 cores)."""
    torch.manual_seed(0)
    model = tiny_vit()
    batch = digits_ds["train"][:]
    x, y = batch["pixel_values"], batch["labels"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(8):
        for idx in torch.randperm(len(y)).split(64):
            loss = model(pixel_values=x[idx], labels=y[idx]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def in_memory_layers(model, pixels, pooling="cls"):
    with torch.no_grad():
        hidden = model(pixel_values=pixels, output_hidden_states=True).hidden_states
    layers = []
    for i, h in enumerate(hidden):
        layers.append(h[:, 1:].mean(1) if (pooling == "mean" or i == 0) else h[:, 0])
    return [layer.numpy() for layer in layers]  # float32, as the streaming path sees them


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_streaming_matches_in_memory_on_vit(digits_ds, pooling):
    model, data = tiny_vit(), digits_ds["test"]
    report = analyze_representations(model, data, batch_size=7, max_examples=150, pooling=pooling)
    subset = data[:150]
    layers = in_memory_layers(model, subset["pixel_values"], pooling)
    labels = subset["labels"].numpy()
    assert report.num_examples == report.num_positions == 150
    assert report.num_layers == len(layers) == 5
    np.testing.assert_allclose(report.fuzziness, [separation_fuzziness(f, labels) for f in layers], rtol=1e-5)
    np.testing.assert_allclose(report.residual, [prediction_residual(f, labels) for f in layers], rtol=1e-5)
    assert report.fuzziness_law.layers == (0, 1, 2, 3, 4)
    assert report.residual_law.layers == (1, 2, 3, 4)


def test_one_hot_residual_option(digits_ds):
    model, data = tiny_vit(), digits_ds["test"]
    report = analyze_representations(model, data, max_examples=120, one_hot_classes=10)
    subset = data[:120]
    last = in_memory_layers(model, subset["pixel_values"])[-1]
    expected = prediction_residual(last, np.eye(10)[subset["labels"].numpy()])
    assert report.residual[-1] == pytest.approx(expected, rel=1e-5)


def test_analysis_restores_training_mode_and_needs_no_grad(digits_ds):
    model = tiny_vit().train()
    analyze_representations(model, digits_ds["test"], max_examples=100)
    assert model.training
    assert all(p.grad is None for p in model.parameters())


def test_warns_when_too_few_rows_for_the_residual(digits_ds):
    with pytest.warns(UserWarning, match="least-squares fit is exact"):
        analyze_representations(tiny_vit(), digits_ds["test"], max_examples=40)


def test_accepts_a_dataloader_of_batches(digits_ds):
    model, data = tiny_vit(), digits_ds["test"]
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    from_loader = analyze_representations(model, loader, max_examples=100)
    from_dataset = analyze_representations(model, data, max_examples=100, batch_size=16)
    assert from_loader.num_examples == 100
    np.testing.assert_allclose(from_loader.fuzziness, from_dataset.fuzziness, rtol=1e-9)


def test_trained_vit_separates_classes_layer_by_layer(trained_vit, digits_ds):
    report = analyze_representations(trained_vit, digits_ds["test"])
    d = report.fuzziness
    assert d[-1] < d[0]
    assert report.fuzziness_law.rho < 1
    assert report.fuzziness_law.r < 0
    untrained = analyze_representations(tiny_vit(), digits_ds["test"])
    assert d[-1] < untrained.fuzziness[-1]  # training, not architecture, did the separating


def test_knn_probe_of_trained_features(trained_vit, digits_ds):
    x_mem, y_mem = extract_features(trained_vit, digits_ds["train"], layer=-1)
    x_q, y_q = extract_features(trained_vit, digits_ds["test"], layer=-1)
    assert x_mem.shape == (1437, 64) and y_q.shape == (360,)
    assert knn_probe(x_mem, y_mem, x_q, y_q) > 0.8


def ragged_token_rows():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 128, size=length).tolist() for length in (9, 1, 5, 12, 2, 7, 12)]


def test_language_positions_and_next_token_targets():
    model = tiny_gpt2()
    rows = ragged_token_rows()
    from datasets import Dataset

    report = analyze_representations(model, Dataset.from_dict({"input_ids": rows}), batch_size=3)
    # Reference: each sequence alone (no padding), every position but the last, target = the next token.
    per_layer, targets = None, []
    with torch.no_grad():
        for row in rows:
            if len(row) < 2:
                continue
            hidden = model(input_ids=torch.tensor([row]), output_hidden_states=True).hidden_states
            feats = [h[0, :-1].double().numpy() for h in hidden]
            per_layer = feats if per_layer is None else [np.r_[a, b] for a, b in zip(per_layer, feats)]
            targets.extend(row[1:])
    assert report.task == "causal-lm" and report.fuzziness is None
    assert report.num_examples == len(rows)
    assert report.num_positions == sum(len(r) - 1 for r in rows) == len(targets)
    # The next token as a class: one-hot over the 128-token vocabulary (up to 256 tokens the target is the one-hot
    # itself); no longer the scalar id, whose arbitrary order a linear fit would measure.
    one_hot = np.eye(model.config.vocab_size)[targets]
    expected = [prediction_residual(f, one_hot) for f in per_layer]
    np.testing.assert_allclose(report.residual, expected, rtol=1e-5)
    assert report.residual_law.layers == (1, 2)


def test_next_token_residual_does_not_depend_on_the_order_of_token_ids():
    """Renumber the vocabulary (the embedding rows follow), so every hidden state is the same: the next-token PR_l is
    unchanged. A fit to the scalar id changes with the numbering (checked here), the reason it is not the target."""
    from datasets import Dataset

    model = tiny_gpt2()
    rows = ragged_token_rows()
    perm = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    renumbered = tiny_gpt2()
    with torch.no_grad():
        renumbered.transformer.wte.weight[perm] = model.transformer.wte.weight  # token t is now perm[t]
    before = analyze_representations(model, Dataset.from_dict({"input_ids": rows}), batch_size=3)
    after = analyze_representations(renumbered, Dataset.from_dict({"input_ids": [perm[r].tolist() for r in rows]}),
                                    batch_size=3)
    np.testing.assert_allclose(after.residual, before.residual, rtol=1e-9)
    feats, ids = extract_features(model, Dataset.from_dict({"input_ids": rows}), layer=-1)
    scalar = [prediction_residual(feats, t.astype(float)) for t in (ids, perm[ids].numpy())]
    assert abs(scalar[0] - scalar[1]) > 0.01


def test_stdlib_corpus_and_byte_fallback():
    text = stdlib_text()
    assert len(text) > 200_000 and "argparse" in text.lower()
    assert max(byte_tokenize("naïve café", 128)) < 128
    with pytest.raises(ValueError, match="≥ 128 tokens"):
        byte_tokenize("abc", 64)
    ds = load_stdlib_blocks(block_size=32)
    assert ds["train"].num_rows > 1000 and ds["test"].num_rows > 100
    report = analyze_representations(tiny_gpt2(), ds["test"], max_examples=24, batch_size=8)
    assert report.num_positions == 24 * 31
    assert all(0 < v <= 1 for v in report.residual)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(task="segmentation"), ValueError, "`task` must be"),
    (dict(pooling="max"), ValueError, "`pooling` must be"),
    (dict(batch_size=0), ValueError, "`batch_size` must be"),
    (dict(label_column="target"), KeyError, "column `target`"),
])
def test_bad_arguments_are_named(digits_ds, kwargs, error, match):
    with pytest.raises(error, match=match):
        analyze_representations(tiny_vit(), digits_ds["test"], max_examples=8, **kwargs)


def test_dataset_without_model_inputs_is_explained():
    from datasets import Dataset

    with pytest.raises(KeyError, match="pixel_values"):
        analyze_representations(tiny_vit(), Dataset.from_dict({"text": ["a", "b"]}))
