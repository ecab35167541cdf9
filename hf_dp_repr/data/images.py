"""Image inputs shared by the image recipe and `hf-dp-repr analyze`: `.npz` arrays, the training subset (an explicit
index file, or N per class by a documented seeded rule), and the preprocessing (the model's image processor, one
named with `--image_processor`, or the model family's known defaults), applied once with `Dataset.map`.

The subset rule of `per_class_indices(labels, n, seed)`: for each class c in increasing order, the rows of class c
in increasing order are permuted with `numpy.random.default_rng(seed).permutation` (one generator, drawn class
after class) and the first n are kept; the union is returned sorted. An index file lists row numbers of the
training split, one per line (`#` starts a comment), e.g. `recipes/configs/cifar10_partial_100_per_class.txt`.

Preprocessing is deterministic (resize, rescale to [0, 1], normalise with mean/std), so it runs once, as a `map`:
the linear probe can then cache the backbone's features (a transform would disable that: it may be augmentation).

    >>> import numpy as np
    >>> per_class_indices(np.array([0, 1, 0, 1, 0, 1]), 2, seed=0).tolist()
    [0, 3, 4, 5]
    >>> from transformers import Dinov2Config
    >>> proc, how = image_processor_for("my/dinov2-folder", Dinov2Config(), pretrained=False)
    >>> proc.size["height"], [round(m, 3) for m in proc.image_mean], "DINOv2" in how
    (224, [0.485, 0.456, 0.406], True)
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ..errors import DPConfigError

logger = logging.getLogger(__name__)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
# model_type → (mean, std, size, name): what the family was pre-trained with (size None: the config's image_size).
# DINOv2's own processor resizes to 256 and centre-crops 224; for small images (CIFAR's 32 px) we resize to 224.
FAMILY_DEFAULTS = {
    "dinov2": (IMAGENET_MEAN, IMAGENET_STD, 224, "DINOv2"),
    "dinov2_with_registers": (IMAGENET_MEAN, IMAGENET_STD, 224, "DINOv2"),
    "deit": (IMAGENET_MEAN, IMAGENET_STD, None, "DeiT"),
    "vit": (HALF, HALF, None, "ViT (google/vit-*)"),
}
# model types whose embeddings interpolate the position embeddings to the input's size in every forward: they take
# any image size (DINOv2 was pre-trained at 518 px, its config's image_size, and is used at 224 px). A model whose
# forward takes `interpolate_pos_encoding` (ViT, DeiT, BEiT, ...) does when it is passed: `interpolate_positions`.
ANY_SIZE_MODEL_TYPES = ("dinov2", "dinov2_with_registers")
INTERPOLATE = "interpolate_pos_encoding"


def _forward_model(model):
    """The model whose forward reads the batch (a PEFT model's base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def takes_interpolation_flag(model) -> bool:
    """Whether `model`'s forward takes `interpolate_pos_encoding` (read from its signature, not its class)."""
    import inspect

    forward = getattr(_forward_model(model), "forward", None)
    return forward is not None and INTERPOLATE in inspect.signature(forward).parameters


def takes_any_image_size(model) -> bool:
    """Whether `model` runs on images of any size: it interpolates its position embeddings in every forward
    (DINOv2), or its forward takes `interpolate_pos_encoding`, which `interpolate_positions` passes."""
    config = getattr(_forward_model(model), "config", None)
    return getattr(config, "model_type", None) in ANY_SIZE_MODEL_TYPES or takes_interpolation_flag(model)


def interpolate_positions(model) -> None:
    """Make `model` (when its forward takes `interpolate_pos_encoding`) interpolate its position embeddings on images
    of another size than `config.image_size`: a forward pre-hook passes `interpolate_pos_encoding=True` when the
    `pixel_values` are of another size and the caller did not pass the flag. Installed once on the model by
    `DPTrainer` (so training, feature caching, evaluation and the representation callback's forward get it) and by
    the commands that load a saved model (`hf-dp-repr analyze`). At the config's size nothing is passed: the forward
    is the one the model was saved with. The per-example gradient of the interpolated position embeddings:
    `privacy.modules.embedding`.

        >>> import torch
        >>> from hf_dp_repr.tiny import tiny_vit
        >>> model = tiny_vit(num_labels=2, image_size=8)
        >>> interpolate_positions(model)
        >>> model(pixel_values=torch.zeros(1, 1, 12, 12)).logits.shape
        torch.Size([1, 2])
    """
    target = _forward_model(model)
    if not takes_interpolation_flag(target) or getattr(target, "_hf_dp_repr_interpolates", False):
        return
    size = getattr(target.config, "image_size", None)
    target.register_forward_pre_hook(PassInterpolationFlag(tuple(size) if isinstance(size, (tuple, list)) else
                                                           (size, size)), with_kwargs=True)
    target._hf_dp_repr_interpolates = True


class PassInterpolationFlag:
    """The forward pre-hook of `interpolate_positions` (a class, so that a model holding it still pickles)."""

    def __init__(self, size: tuple):
        self.size = size

    def __call__(self, module, args, kwargs):
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        other_size = getattr(pixels, "ndim", 0) == 4 and tuple(pixels.shape[-2:]) != self.size
        if other_size and kwargs.get(INTERPOLATE) is None:
            kwargs = {**kwargs, INTERPOLATE: True}
        return args, kwargs


# ---- arrays and subsets ---------------------------------------------------------------------------------------
def load_npz(path: str, num_labels: int | None = None):
    """A DatasetDict (train, test) from a .npz of uint8 images (N, H, W, C) and int labels: x_train, y_train, x_test,
    y_test (e.g. CIFAR arrays), and optionally class_names. The classes are declared (class_names, or
    `num_labels`), never read off the labels."""
    import datasets

    arrays = np.load(path)
    missing = {"x_train", "y_train", "x_test", "y_test"} - set(arrays.files)
    if missing:
        raise DPConfigError(f"{path}: a .npz needs x_train, y_train, x_test, y_test; missing {sorted(missing)}")
    names = [str(n) for n in arrays["class_names"]] if "class_names" in arrays.files else None
    if names is None and num_labels is None:
        raise DPConfigError(f"{path}: the .npz declares no class_names; pass --num_labels N (labels 0..N-1), e.g. "
                            "--num_labels 10 for CIFAR-10.")
    if names is not None and num_labels is not None and num_labels != len(names):
        raise DPConfigError(f"--num_labels {num_labels}, but {path} declares {len(names)} class_names; drop "
                            "--num_labels.")
    n_classes = len(names) if names is not None else num_labels
    for key in ("y_train", "y_test"):
        y = arrays[key]
        if y.size and (y.min() < 0 or y.max() >= n_classes):
            raise DPConfigError(f"{path}: {key} holds labels outside 0..{n_classes - 1} (the declared classes); fix "
                                "the arrays or --num_labels.")
    label = datasets.ClassLabel(names=names) if names is not None else datasets.ClassLabel(num_classes=n_classes)
    features = datasets.Features({"img": datasets.Image(), "label": label})

    def split(x, y):
        return datasets.Dataset.from_dict({"img": list(x), "label": [int(v) for v in y]}, features=features)

    return datasets.DatasetDict(train=split(arrays["x_train"], arrays["y_train"]),
                                test=split(arrays["x_test"], arrays["y_test"]))


def per_class_indices(labels, n: int, seed: int) -> np.ndarray:
    """Rows kept by `--max_train_samples_per_class n` with `--seed seed` (the rule in this module's docstring)."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    keep = [rng.permutation(np.flatnonzero(labels == c))[:n] for c in np.unique(labels)]
    return np.sort(np.concatenate(keep))


def read_index_file(path: str | os.PathLike, num_rows: int) -> list[int]:
    """The row numbers listed in `path` (one per line, `#` comments), checked: in range, no repeats."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                rows.append(int(line))
    bad = [i for i in rows if not 0 <= i < num_rows]
    if bad:
        raise DPConfigError(f"--train_indices_file {path}: rows {bad[:5]} are outside the training split (0.."
                            f"{num_rows - 1}).")
    if len(set(rows)) != len(rows):
        raise DPConfigError(f"--train_indices_file {path}: rows repeat; an example listed twice would be one unit "
                            "of privacy counted twice.")
    return rows


def write_index_file(path: str | os.PathLike, rows, header: str) -> None:
    """Write `rows` (one per line) under a `# header` comment: the file `read_index_file` reads."""
    lines = [f"# {h}" for h in header.splitlines()] + [str(int(i)) for i in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# ---- preprocessing ------------------------------------------------------------------------------------------------
def image_processor_for(name_or_path: str, config, *, pretrained: bool = True, image_processor: str | None = None,
                        image_size: int | None = None, image_mean=None, image_std=None):
    """(image processor, one line saying what it does and where that came from).

    In order: `image_processor` (a Hub name or folder) if given; else the model's own (`pretrained`: try
    `AutoImageProcessor.from_pretrained(name_or_path)`); else the family's known defaults (`FAMILY_DEFAULTS`, by
    `config.model_type`); else mean = std = 0.5 with a warning asking for `--image_mean/--image_std`.
    `image_size`, `image_mean`, `image_std` override whatever was found."""
    from transformers import AutoImageProcessor

    processor, source = None, None
    if image_processor or pretrained:
        try:
            processor = AutoImageProcessor.from_pretrained(image_processor or name_or_path)
            source = f"the image processor of {image_processor or name_or_path}"
        except OSError:
            if image_processor:
                raise DPConfigError(f"--image_processor {image_processor}: no image processor there "
                                    "(preprocessor_config.json).") from None
    if processor is None:
        mean, std, size, family = FAMILY_DEFAULTS.get(getattr(config, "model_type", None), (None, None, None, None))
        size = size or getattr(config, "image_size", None) or 224
        if family:
            source = f"the {family} family's defaults (no image processor with the model)"
        elif image_mean is None or image_std is None:
            logger.warning("no image processor with %s and no known defaults for model_type %r: normalising with "
                           "mean = std = 0.5. Pass --image_mean/--image_std (or --image_processor) with the values "
                           "the model was pre-trained with.", name_or_path, getattr(config, "model_type", None))
            source = "mean = std = 0.5 (unknown family)"
        processor = _resize_normalize(size, mean or HALF, std or HALF)
    if image_size or image_mean is not None or image_std is not None:  # resize + normalise with what was given
        size = image_size or processor.size.get("height") or processor.size.get("shortest_edge")
        processor = _resize_normalize(size, processor.image_mean if image_mean is None else image_mean,
                                      processor.image_std if image_std is None else image_std)
        source += ", with --image_size/--image_mean/--image_std applied"
    processor, source = _match_channels(processor, source, getattr(config, "num_channels", None),
                                        given=image_mean is not None or image_std is not None)
    return processor, f"{describe(processor)}, from {source}"


def _match_channels(processor, source: str, channels: int | None, given: bool):
    """A mean/std of one value per channel of the model: a 3-channel default for a 1-channel model becomes one value
    (the average, as the image is converted to grey), said in `source`; a mean/std the user gave of another length is
    refused (transformers would raise a ValueError at the first image)."""
    mean, std = list(processor.image_mean), list(processor.image_std)
    if channels is None or (len(mean) == channels and len(std) == channels):
        return processor, source
    if given:
        raise DPConfigError(f"--image_mean {mean} / --image_std {std}: the model takes {channels} channel(s) "
                            f"(config.num_channels); give {channels} value(s) each.")
    if channels != 1:
        raise DPConfigError(f"the image processor's mean/std have {len(mean)} values but the model takes {channels} "
                            "channels (config.num_channels): pass --image_mean/--image_std with one value per channel.")
    size = processor.size.get("height") or processor.size.get("shortest_edge")
    one = _resize_normalize(size, [sum(mean) / len(mean)], [sum(std) / len(std)])
    return one, source + ", averaged to 1 channel (the model takes 1 channel; images converted to grey)"


def _resize_normalize(size: int, mean, std):
    """Resize to size × size, rescale to [0, 1], normalise: the PIL backend when torchvision is missing (transformers
    would otherwise warn that it falls back to it)."""
    import importlib.util

    import transformers

    cls = (transformers.ViTImageProcessor if importlib.util.find_spec("torchvision")
           else transformers.ViTImageProcessorPil)
    return cls(size={"height": int(size), "width": int(size)}, image_mean=list(mean), image_std=list(std),
               do_resize=True, do_rescale=True, do_normalize=True)


def describe(processor) -> str:
    size = processor.size
    px = f"{size['height']}×{size['width']}" if "height" in size else f"shortest edge {size.get('shortest_edge')}"
    fmt = lambda v: "(" + ", ".join(f"{x:.3g}" for x in v) + ")"  # noqa: E731
    return f"resize to {px} px, mean {fmt(processor.image_mean)}, std {fmt(processor.image_std)}"


def to_pixel_values(dataset, image_col: str, processor, num_channels: int = 3, desc: str = "preprocessing images"):
    """`dataset` with `image_col` replaced by `pixel_values` (float32), computed once with `map` (cached by
    `datasets` when the dataset has cache files), in torch format."""
    mode = "RGB" if num_channels == 3 else "L"

    def fn(batch):
        images = [im.convert(mode) for im in batch[image_col]]
        return {"pixel_values": processor(images, return_tensors="np")["pixel_values"].astype(np.float32)}

    out = dataset.map(fn, batched=True, batch_size=64, remove_columns=[image_col], desc=desc)
    return out.with_format("torch")


# ---- a shifted public distribution --------------------------------------------------------------------------------
def _blur(x):
    import torch

    c = x.shape[-3]
    kernel = torch.full((c, 1, 3, 3), 1 / 9, dtype=x.dtype)
    return torch.nn.functional.conv2d(x.reshape(-1, *x.shape[-3:]), kernel, padding=1, groups=c).reshape(x.shape)


# name → a fixed map of pixel values (…, C, H, W): the public images' distribution differs from the private task's
PUBLIC_SHIFTS = {
    "none": lambda x: x,
    "rotate90": lambda x: x.rot90(1, (-2, -1)),
    "mirror": lambda x: x.flip(-1),
    "invert": lambda x: -x,
    "blur": _blur,
}


def shift_images(dataset, shift: str):
    """`dataset` with every `pixel_values` passed through `PUBLIC_SHIFTS[shift]` (a fixed map, once, with `map`).

        >>> import torch
        >>> from datasets import Dataset
        >>> ds = Dataset.from_dict({"pixel_values": [[[[0.0, 1.0], [2.0, 3.0]]]]}).with_format("torch")
        >>> shift_images(ds, "rotate90")[0]["pixel_values"].tolist()
        [[[1.0, 3.0], [0.0, 2.0]]]
    """
    if shift not in PUBLIC_SHIFTS:
        raise DPConfigError(f"public shift {shift!r}: choose one of {sorted(PUBLIC_SHIFTS)}")
    if shift == "none":
        return dataset
    fn = PUBLIC_SHIFTS[shift]
    return dataset.map(lambda b: {"pixel_values": fn(b["pixel_values"])}, batched=True,
                       desc=f"public images: {shift}").with_format("torch")


# ---- a random augmentation of the private training images ----------------------------------------------------------
def _random_shift(x):
    """Each image of `x` (N, C, H, W) moved by -1, 0 or +1 pixel along each axis (edge pixels repeated), the offsets
    drawn from torch's global generator (which `augmentation_multiplicity` seeds per view: privacy.augmentation)."""
    import torch

    n, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate")
    dy, dx = torch.randint(0, 3, (2, n))
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None].expand(n, c, h, w + 2)  # each image's window, one gather
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :].expand(n, c, h, w)
    return padded.gather(2, rows).gather(3, cols)


TRAIN_AUGMENTATIONS = {"none": None, "random_shift": _random_shift}  # name → random map of pixel values (N, C, H, W)


def augment_images(dataset, augmentation: str):
    """`dataset` with `TRAIN_AUGMENTATIONS[augmentation]` as its transform (`Dataset.with_transform`): a new random
    draw every time a row is read, so features are not cached (the linear probe then runs the backbone every step).

        >>> import torch
        >>> from datasets import Dataset
        >>> ds = Dataset.from_dict({"pixel_values": [torch.randn(1, 8, 8).tolist()], "labels": [3]})
        >>> row = augment_images(ds, "random_shift")[0]
        >>> tuple(row["pixel_values"].shape), int(row["labels"])
        ((1, 8, 8), 3)
    """
    if augmentation not in TRAIN_AUGMENTATIONS:
        raise DPConfigError(f"train augmentation {augmentation!r}: choose one of {sorted(TRAIN_AUGMENTATIONS)}")
    fn = TRAIN_AUGMENTATIONS[augmentation]
    if fn is None:
        return dataset

    def transform(batch):
        import torch

        out = {k: torch.as_tensor(v) for k, v in batch.items()}
        out["pixel_values"] = fn(out["pixel_values"].float())
        return out

    return dataset.with_transform(transform)
