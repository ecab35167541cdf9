"""Seed-000 proxy, tuned (issue 12): a DP linear probe at ε = 1 on DINOv2-S features of 100 CIFAR-10 images per class,
its hyperparameters found by `DPTrainer.hyperparameter_search(tuning_data="held_out")`. Not a test: needs
../shared/data (README "Tuning under DP", "Seed-000 proxy, tuned", for the measured numbers).

    export OMP_WAIT_POLICY=PASSIVE
    python benchmarks/seed000_proxy_tuning.py --stage features    # once: the backbone pass (38 min at load 4-6 here)
    python benchmarks/seed000_proxy_tuning.py --n_trials 40 --private_gamma 0.1 --output_dir out/s000-tuned
    python benchmarks/seed000_proxy_tuning.py --stage repeats --output_dir out/s000-tuned   # spread, held-out only
    python benchmarks/seed000_proxy_tuning.py --stage sanity      # what plain torch DP-SGD reaches (held-out only)

(`--cache FILE`, or HF_DP_REPR_PROXY_CACHE, says where the features go; from a source checkout whose package is
installed elsewhere, put the checkout first: `PYTHONPATH=$PWD python benchmarks/...`.)

Data (rows of x_train in cifar10_partial.npz; `splits` states the rule):
- private: the 1000 of recipes/configs/cifar10_partial_100_per_class.txt, the set the final model protects;
- tune: 100 per class held out from the rest: every trial trains on these (same n = 1000, so a trial's σ for a
  schedule is the final run's σ for it: the calibration transfers);
- val: the other 3085 held-out rows: every trial is scored on these;
- test: the 1017 test images, used once, by the final run (and by the optional private-mode search's best model).

Stages of `--stage all`:
1. features (if the cache file is missing): per image, the public backbone in eval mode; no statistic of any set;
2. the search: Optuna (TPE) over logical batch (250, 500, 1000 = full batch), steps, learning rate, clipping norm,
   flat vs automatic clipping, SGD with or without momentum, the schedule, head_init (zeros or the model's own),
   and in `model_init(trial)` the features ([CLS], or [CLS | mean patch] as Dinov2ForImageClassification) and
   their per-example transform (raw; L2; centred or standardised + L2; PCA to K dims + whitening + L2), where means,
   stds and principal axes come from the held-out "tune" features only. Every trial spends exactly ε (its σ is
   calibrated by the prv accountant for its schedule);
3. the untuned shipped config (recipes/configs/seed000_dinov2s_cifar10partial_probe_eps1.yaml) on tune → val;
4. ONE DP run with the best hyperparameters on the private 1000 at ε, evaluated once on the test images. Its
   privacy cost on the private individuals is that run's ε; the held-out individuals get no guarantee (they chose
   the hyperparameters, and their mean/std/principal axes are buffers of the released model);
5. with --private_gamma γ: the search again, on the private 1000 (tuning_data="private", a geometric number of
   trials of mean 1/γ, Papernot-Steinke), its total ε printed and its best model evaluated on test. A separate
   experiment on the same private data: publishing both it and step 4 composes their costs.
Writes report.json and each search's hp_search_trials.csv/.png under --output_dir.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

DATA = os.environ.get("HF_DP_REPR_SHARED_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
NPZ = os.path.join(DATA, "cifar10_partial.npz")
MODEL = os.path.join(DATA, "dinov2-small-imgfocus")
CACHE = os.environ.get("HF_DP_REPR_PROXY_CACHE",
                       os.path.expanduser("~/.cache/hf-dp-repr/seed000_dinov2s_features.npz"))


# ---- 1. public-model inference, once ------------------------------------------------------------------------------
def compute_features(path: str = CACHE, batch_size: int = 32, max_val: int | None = None) -> None:
    """DINOv2-S features of the proxy's images, saved to `path`.

    Per image, in eval mode without autograd: the final layer-normed [CLS] token (384) and the mean of the patch
    tokens (384), i.e. the two halves of what `Dinov2ForImageClassification`'s head reads. Preprocessing is the
    recipe's (`image_processor_for`: resize to 224 px, ImageNet mean/std). No statistic of any set of examples is
    computed: each feature depends on its own image and the public backbone only.

    Resumable on a busy machine: each batch is saved under `path`.parts/ as soon as it is done and skipped when the
    pass runs again. Rows go in the order private, tune, test, val; `max_val` keeps only that many "val" rows (a
    fixed random subset: `load_features` then scores validation on them)."""
    from transformers import AutoConfig, AutoModel

    from hf_dp_repr.data.images import describe, image_processor_for

    config = AutoConfig.from_pretrained(MODEL)
    processor, how = image_processor_for(MODEL, config, image_size=224)
    model = AutoModel.from_pretrained(MODEL, dtype=torch.float32).eval()
    arrays = np.load(NPZ)
    rows = splits(arrays["y_train"])
    if max_val is not None:
        rows["val"] = np.sort(np.random.default_rng(2).permutation(rows["val"])[:max_val])
    jobs = [("train", rows[k]) for k in ("private", "tune")] + [("test", np.arange(len(arrays["y_test"])))] \
        + [("train", rows["val"])]
    parts = path + ".parts"
    os.makedirs(parts, exist_ok=True)
    start, done, total = time.perf_counter(), 0, sum(len(r) for _, r in jobs)
    for split, index in jobs:
        for i in range(0, len(index), batch_size):
            batch = index[i:i + batch_size]
            part = os.path.join(parts, f"{split}_{batch[0]:05d}_{len(batch)}.npz")
            done += len(batch)
            if os.path.exists(part):
                continue
            pixels = processor(list(arrays[f"x_{split}"][batch]), return_tensors="pt")["pixel_values"]
            with torch.inference_mode():
                hidden = model(pixel_values=pixels).last_hidden_state  # after the final layernorm
            np.savez(part + ".tmp.npz", rows=batch, cls=hidden[:, 0].numpy(), patch=hidden[:, 1:].mean(1).numpy())
            os.replace(part + ".tmp.npz", part)
            print(f"{done}/{total}  {time.perf_counter() - start:.0f} s", flush=True)
    out = {}
    for split in ("train", "test"):
        n = len(arrays[f"y_{split}"])
        cls, patch = np.full((n, 384), np.nan, np.float32), np.full((n, 384), np.nan, np.float32)
        have = np.zeros(n, bool)
        for name in sorted(os.listdir(parts)):
            if name.startswith(split + "_") and name.endswith(".npz") and ".tmp" not in name:
                f = np.load(os.path.join(parts, name))
                cls[f["rows"]], patch[f["rows"]], have[f["rows"]] = f["cls"], f["patch"], True
        out.update({f"cls_{split}": cls, f"patch_{split}": patch, f"have_{split}": have,
                    f"y_{split}": arrays[f"y_{split}"].astype(np.int64)})
    np.savez(path + ".tmp.npz", preprocessing=np.array(describe(processor)), model=np.array(os.path.abspath(MODEL)),
             **out)
    os.replace(path + ".tmp.npz", path)
    print(f"saved {path} ({how}; {time.perf_counter() - start:.0f} s)")


# ---- 2. splits and features -------------------------------------------------------------------------------------
PRIVATE_INDEX = os.path.join(os.path.dirname(__file__), "..", "recipes", "configs", "cifar10_partial_100_per_class.txt")
HELD_OUT_SEED = 1


def splits(y_train: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of x_train: "private" (the index file: the 1000 the final model protects), "tune" (100 per class held
    out from them: the search trains on these) and "val" (every other row: the search scores on these).

    The held-out rule: for each class c in increasing order, the rows of class c NOT in the private index file, in
    increasing order, permuted with one `numpy.random.default_rng(1)` (drawn class after class); the first 100 are
    "tune", the rest "val". The three sets are disjoint; none of them is the test split."""
    from hf_dp_repr.data.images import read_index_file

    private = np.array(sorted(read_index_file(PRIVATE_INDEX, len(y_train))))
    rest = np.setdiff1d(np.arange(len(y_train)), private)
    rng = np.random.default_rng(HELD_OUT_SEED)
    tune, val = [], []
    for c in np.unique(y_train):
        rows = rng.permutation(rest[y_train[rest] == c])
        tune.append(rows[:100])
        val.append(rows[100:])
    out = {"private": private, "tune": np.sort(np.concatenate(tune)), "val": np.sort(np.concatenate(val))}
    assert not (set(out["private"]) & set(out["tune"]) or set(out["private"]) & set(out["val"])
                or set(out["tune"]) & set(out["val"]))
    return out


def load_features(path: str = CACHE) -> dict:
    """The cached features, split: {name: (x (n, 768) = [CLS | mean patch], y)} for private, tune, val, test."""
    f = np.load(path)
    train = np.concatenate([f["cls_train"], f["patch_train"]], 1)
    rows = splits(f["y_train"])
    have = f["have_train"] if "have_train" in f else np.ones(len(train), bool)
    complete_test = "have_test" not in f or f["have_test"].all()
    if not (have[rows["private"]].all() and have[rows["tune"]].all() and complete_test):
        raise SystemExit(f"{path}: the feature pass is incomplete; run `--stage features` again (it resumes)")
    rows["val"] = rows["val"][have[rows["val"]]]  # `--max_val`: the subset that was computed
    out = {k: (train[v], f["y_train"][v]) for k, v in rows.items()}
    out["test"] = (np.concatenate([f["cls_test"], f["patch_test"]], 1), f["y_test"])
    return out


FEATURES = {"cls": slice(0, 384), "cls+patch": slice(0, 768)}  # cls+patch: what Dinov2ForImageClassification reads
PCA_DIMS = (8, 16, 32, 64, 128)
NORMS = ("raw", "l2", "center_l2", "standardize_l2") + tuple(f"pca{k}" for k in PCA_DIMS)


def held_out_stats(x_public: np.ndarray) -> dict:
    """Statistics of the held-out "tune" features (never of the private set, never of val or test), per feature
    set: per-dimension mean and std, and the principal axes of the standardised features with their scales."""
    stats = {}
    for name, cols in FEATURES.items():
        mask = np.zeros(768, np.float32)
        mask[cols] = 1
        mean, std = np.zeros(768, np.float32), np.ones(768, np.float32)
        mean[cols], std[cols] = x_public[:, cols].mean(0), x_public[:, cols].std(0) + 1e-6
        z = (x_public[:, cols] - mean[cols]) / std[cols]
        _, sv, vt = np.linalg.svd(z, full_matrices=False)
        axes = np.zeros((768, max(PCA_DIMS)), np.float32)
        axes[cols] = vt[:max(PCA_DIMS)].T / (sv[:max(PCA_DIMS)] / np.sqrt(len(z)))  # whitened: unit variance each
        stats[name] = {"mask": mask, "mean": mean, "std": std, "axes": axes}
    return stats


def transform_buffers(features: str, norm: str, stats: dict) -> dict:
    """The fixed per-example transform of (features, norm) as tensors: x ↦ ((x·mask − mean) / std) [@ axes[:, :k]],
    then divided by its L2 norm unless norm == "raw".
    raw: as is; l2: per-example L2 normalisation; center_l2 / standardize_l2: centred / standardised with the
    held-out mean (and std) first; pcaK: standardised, projected on the top K principal axes of the held-out
    features, whitened, then L2-normalised."""
    st = stats[features]
    centre = norm != "raw" and norm != "l2"
    scale = norm == "standardize_l2" or norm.startswith("pca")
    k = int(norm[3:]) if norm.startswith("pca") else 0
    axes = np.zeros_like(st["axes"])
    axes[:, :k] = st["axes"][:, :k]
    return {"mask": torch.tensor(st["mask"]),
            "mean": torch.tensor(st["mean"] if centre else np.zeros(768, np.float32)),
            "std": torch.tensor(st["std"] if scale else np.ones(768, np.float32)),
            "axes": torch.tensor(axes), "pca": torch.tensor(k > 0), "l2": torch.tensor(norm != "raw")}


def apply_transform(x: torch.Tensor, b: dict) -> torch.Tensor:
    """Per example: each row depends on itself and on the fixed held-out statistics only."""
    x = (x * b["mask"] - b["mean"]) / b["std"]
    if bool(b["pca"]):
        x = torch.nn.functional.pad(x @ b["axes"], (0, 768 - b["axes"].shape[1]))
    if bool(b["l2"]):
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return x


# ---- 3. sanity check: plain torch DP-SGD, σ from the library's calibration ---------------------------------------
def dp_sgd_linear(x, y, xv, yv, *, steps, batch, lr, clip, sigma, momentum=0.0, zero_init=True, seed=0,
                  automatic=False):
    """DP-SGD (Poisson batches of expected size `batch`, per-example clipping, Gaussian noise σ·C) on a linear
    softmax head, per-example gradients in closed form; returns validation accuracy."""
    g = torch.Generator().manual_seed(seed)
    n, d = x.shape
    k = int(y.max()) + 1
    w = torch.zeros(d + 1, k) if zero_init else torch.randn(d + 1, k, generator=g) / d ** 0.5
    xb = torch.cat([x, torch.ones(n, 1)], 1)
    onehot = torch.nn.functional.one_hot(y, k).float()
    buf = torch.zeros_like(w)
    for _ in range(steps):
        m = torch.rand(n, generator=g) < batch / n
        xs, ys = xb[m], onehot[m]
        r = torch.softmax(xs @ w, 1) - ys  # dL/dlogits
        norms = r.norm(dim=1) * xs.norm(dim=1)
        f = clip / (norms + 0.01) if automatic else (clip / norms.clamp_min(1e-12)).clamp(max=1.0)
        grad = (xs * f[:, None]).T @ r + sigma * clip * torch.randn(d + 1, k, generator=g)
        grad /= batch
        buf = momentum * buf + grad
        w -= lr * buf
    xvb = torch.cat([xv, torch.ones(len(xv), 1)], 1)
    return float(((xvb @ w).argmax(1) == yv).float().mean())


def sanity(data: dict, epsilon: float, delta: float, schedules=((100, 1000), (400, 1000), (160, 250)),
           variants=None) -> None:
    """What a DP linear probe can reach at this ε on the held-out split (trained on "tune", scored on "val"): for
    each (steps, batch) and each (features, norm) variant, the best of a small lr × momentum grid (C = 1)."""
    from hf_dp_repr.privacy.accounting import calibrate_noise_multiplier

    torch.set_num_threads(1)
    x, y = (torch.tensor(a) for a in data["tune"])
    xv, yv = (torch.tensor(a) for a in data["val"])
    stats = held_out_stats(data["tune"][0])
    n = len(y)
    for steps, batch in schedules:
        sigma = calibrate_noise_multiplier(epsilon, delta, batch / n, steps, "prv")
        for feats, norm in variants or [(f, v) for f in FEATURES for v in NORMS]:
            xs, xvs = (apply_transform(a, transform_buffers(feats, norm, stats)) for a in (x, xv))
            scale = 1.0 if norm != "raw" else float(xs.norm(dim=1).median())
            best = max((dp_sgd_linear(xs, y, xvs, yv, steps=steps, batch=batch, lr=lr, clip=1.0, sigma=sigma,
                                      momentum=mom), lr, mom)
                       for lr in (0.1 / scale, 0.3 / scale, 1 / scale, 3 / scale, 10 / scale, 30 / scale, 100 / scale)
                       for mom in (0.0, 0.9))
            print(f"steps {steps:5d} batch {batch:5d} σ {sigma:7.3f} {feats:9s} {norm:15s} val acc {best[0]:.3f} "
                  f"(lr {best[1]:.3g}, C 1, momentum {best[2]})", flush=True)


# ---- 4. the probe as a model DPTrainer trains ------------------------------------------------------------------
class FeatureSet(torch.utils.data.Dataset):
    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = torch.tensor(x), torch.tensor(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"features": self.x[i], "labels": self.y[i]}


class FeatureTransform(torch.nn.Module):
    """The frozen "base model": the fixed per-example transform of `transform_buffers` (which features, centring,
    scaling, PCA, L2). No parameters; its choices are buffers, so a state dict restores them."""

    def __init__(self, features: str, norm: str, stats: dict):
        super().__init__()
        for name, value in transform_buffers(features, norm, stats).items():
            self.register_buffer(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_transform(x, dict(self.named_buffers()))


class FeatureProbe(torch.nn.Module):
    """A linear head on cached DINOv2-S features, shaped like an HF classifier: `base_model` (fixed) + `classifier`,
    and a forward that returns a `SequenceClassifierOutput` with `.logits` (DPTrainer reads `outputs.logits`).
    The classifier always has 768 inputs; those the transform sets to 0 (the patch half with features="cls", the
    columns past K with pcaK) make it the same probe as a smaller one: their weights get no gradient from any
    example, and their noise never reaches a logit."""

    def __init__(self, features: str, norm: str, stats: dict, num_labels: int = 10):
        super().__init__()
        self.base_model = FeatureTransform(features, norm, stats)
        self.classifier = torch.nn.Linear(768, num_labels)
        torch.nn.init.trunc_normal_(self.classifier.weight, std=0.02)  # as Dinov2ForImageClassification
        torch.nn.init.zeros_(self.classifier.bias)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.classifier(self.base_model(features))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def accuracy(p) -> dict:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


BATCHES = [250, 500, 1000]  # logical batch, up to the full 1000
STEPS = [25, 50, 100, 200, 400]
# The untuned shipped config (recipes/configs/seed000_dinov2s_cifar10partial_probe_eps1.yaml) in these terms.
SHIPPED = {"features": "cls+patch", "feature_norm": "raw", "per_device_train_batch_size": 250, "max_steps": 160,
           "learning_rate": 0.1, "per_sample_max_grad_norm": 1.0, "clipping": "flat", "optim_args": "momentum=0.0",
           "lr_scheduler_type": "linear", "head_init": "default"}


def hp_space(trial) -> dict:
    """DPTrainingArguments fields; the features and their normalisation are drawn in `model_init(trial)`. Schedule
    keys (batch, steps) are categorical, as mode "private" needs."""
    return {
        "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", BATCHES),
        "max_steps": trial.suggest_categorical("max_steps", STEPS),
        "learning_rate": trial.suggest_float("learning_rate", 3e-3, 30.0, log=True),
        "per_sample_max_grad_norm": trial.suggest_float("per_sample_max_grad_norm", 0.1, 10.0, log=True),
        "clipping": trial.suggest_categorical("clipping", ["flat", "automatic"]),
        "optim_args": trial.suggest_categorical("optim_args", ["momentum=0.0", "momentum=0.9"]),
        "lr_scheduler_type": trial.suggest_categorical("lr_scheduler_type", ["constant", "linear", "cosine"]),
        "head_init": trial.suggest_categorical("head_init", ["zeros", "default"]),
    }


def make_model_init(stats, features=tuple(FEATURES), norms=NORMS):
    def model_init(trial=None):
        if trial is None:  # the shape of every trial's model (a state dict then sets its buffers and weights)
            return FeatureProbe("cls+patch", "raw", stats)
        return FeatureProbe(trial.suggest_categorical("features", list(features)),
                            trial.suggest_categorical("feature_norm", list(norms)), stats)
    return model_init


def dp_args(out: str, epsilon: float, delta: float, **kw):
    from hf_dp_repr import DPTrainingArguments

    return DPTrainingArguments(
        output_dir=out, target_epsilon=epsilon, target_delta=delta, accountant="prv", optim="sgd",
        per_device_eval_batch_size=4096, report_to="none", save_strategy="no", eval_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, seed=0, **kw)


def search(data, out, epsilon, delta, n_trials, mode, gamma, features=tuple(FEATURES), norms=NORMS):
    """The Optuna search through `DPTrainer.hyperparameter_search`: returns (BestRun, trainer)."""
    import warnings

    from hf_dp_repr import DPTrainer
    from hf_dp_repr.tuning.selection_privacy import TrialCount

    stats = held_out_stats(data["tune"][0])
    train = data["tune"] if mode == "held_out" else data["private"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer = DPTrainer(model_init=make_model_init(stats, features, norms), args=dp_args(out, epsilon, delta),
                            train_dataset=FeatureSet(*train), eval_dataset=FeatureSet(*data["val"]),
                            compute_metrics=accuracy)
    kw = dict(n_trials=n_trials) if mode == "held_out" else dict(trial_count=TrialCount.geometric(gamma),
                                                                   eval_data_public=True)
    best = trainer.hyperparameter_search(hp_space=hp_space, compute_objective=lambda m: m["eval_accuracy"],
                                         direction="maximize", backend="optuna", tuning_data=mode,
                                         keep_best_model=mode == "private", **kw)
    return best, trainer


def train_once(params, x, y, out, epsilon, delta, stats):
    """One DP run of `params` on (x, y): returns the trainer (σ calibrated for exactly ε)."""
    from hf_dp_repr import DPTrainer

    fields = {k: v for k, v in params.items() if k not in ("features", "feature_norm")}
    model = FeatureProbe(params["features"], params["feature_norm"], stats)
    trainer = DPTrainer(model=model, args=dp_args(out, epsilon, delta, **fields), train_dataset=FeatureSet(x, y),
                        compute_metrics=accuracy)
    trainer.train()
    return trainer


def repeats(data, args) -> None:
    """The spread of one DP run: the best configuration of `--output_dir`'s report.json and the shipped one, each
    trained `--repeats` times with fresh noise on the held-out "tune" 1000 and scored on "val" (no private data)."""
    import warnings

    torch.set_num_threads(args.threads)
    with open(os.path.join(args.output_dir, "report.json")) as f:
        report = json.load(f)
    stats = held_out_stats(data["tune"][0])
    out = {}
    for name, params in (("best", report["search"]["best_params"]), ("shipped", SHIPPED)):
        accs = []
        for i in range(args.repeats):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = train_once(params, *data["tune"], os.path.join(args.output_dir, f"repeat_{name}"), args.epsilon,
                               args.delta, stats)
            accs.append(t.evaluate(FeatureSet(*data["val"]))["eval_accuracy"])
        out[name] = {"val_accuracy": accs, "mean": float(np.mean(accs)), "std": float(np.std(accs, ddof=1))}
        print(f"{name}: val accuracy over {args.repeats} runs {np.mean(accs):.4f} ± {np.std(accs, ddof=1):.4f} "
              f"({', '.join(f'{a:.3f}' for a in accs)})", flush=True)
    report["repeats_on_val"] = out
    with open(os.path.join(args.output_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["features", "sanity", "all", "repeats"], default="all")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache", default=CACHE)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-4)
    parser.add_argument("--n_trials", type=int, default=40)
    parser.add_argument("--private_gamma", type=float, default=0.0,
                        help="also run mode 'private' with a geometric number of trials of mean 1/γ (0: skip)")
    parser.add_argument("--features", nargs="+", choices=list(FEATURES), default=list(FEATURES),
                        help="feature sets to search over (cls+patch alone with --norms raw: what the image recipe's "
                             "Dinov2ForImageClassification head reads, so the result can go into its config)")
    parser.add_argument("--norms", nargs="+", choices=list(NORMS), default=list(NORMS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max_val", type=int, help="features: compute only this many of the 3085 'val' rows")
    parser.add_argument("--output_dir", default="out/seed000-proxy-tuning")
    args = parser.parse_args()
    if args.stage == "features" or not os.path.exists(args.cache):
        compute_features(args.cache, max_val=args.max_val)
    if args.stage == "features":
        return
    data = load_features(args.cache)
    if args.stage == "sanity":
        sanity(data, args.epsilon, args.delta)
        return
    if args.stage == "repeats":
        repeats(data, args)
        return
    torch.set_num_threads(args.threads)
    os.makedirs(args.output_dir, exist_ok=True)
    report = {"epsilon": args.epsilon, "delta": args.delta, "sizes": {k: len(v[1]) for k, v in data.items()},
              "load_before": os.getloadavg()}
    stats = held_out_stats(data["tune"][0])

    # (a) the search: trials train on the held-out "tune" 1000 and are scored on "val"; the private 1000 unused
    start = time.perf_counter()
    best, _ = search(data, os.path.join(args.output_dir, "held_out"), args.epsilon, args.delta, args.n_trials,
                     "held_out", None, args.features, args.norms)
    report["search"] = {"best_params": best.hyperparameters, "best_val_accuracy": best.objective,
                        "trial": best.run_id, "seconds": time.perf_counter() - start, "load": os.getloadavg()}
    print(f"search: {args.n_trials} trials in {report['search']['seconds']:.0f} s; best val accuracy "
          f"{best.objective:.4f}: {best.hyperparameters}", flush=True)

    # (b) the untuned shipped config on the same held-out split (no private data): what the search gained there
    base = train_once(SHIPPED, *data["tune"], os.path.join(args.output_dir, "shipped_on_tune"), args.epsilon,
                      args.delta, stats)
    report["shipped_on_val"] = base.evaluate(FeatureSet(*data["val"]))["eval_accuracy"]

    # (c) ONE DP run on the private 1000 with the best hyperparameters, evaluated once on the 1017 test images
    start = time.perf_counter()
    final = train_once(best.hyperparameters, *data["private"], os.path.join(args.output_dir, "final"), args.epsilon,
                       args.delta, stats)
    led = final.ledger
    report["final"] = {"test_accuracy": final.evaluate(FeatureSet(*data["test"]))["eval_accuracy"],
                       "epsilon_spent": led.epsilon(), "delta": led.plan.target_delta,
                       "accountant": led.plan.accountant, "sigma": led.plan.phases[-1].noise_multiplier,
                       "sample_rate": led.plan.phases[-1].sample_rate,
                       "steps": led.steps_done, "seconds": time.perf_counter() - start}
    print(f"final run on the private 1000: test accuracy {report['final']['test_accuracy']:.4f} at ε = "
          f"{led.epsilon():.4f}, δ = {led.plan.target_delta:g} (σ = {led.plan.phases[-1].noise_multiplier:.3f}, "
          f"{led.steps_done} steps)", flush=True)

    # (d) optional: tune on the private 1000 itself, accounted with Papernot & Steinke (a separate experiment)
    if args.private_gamma:
        from hf_dp_repr.tuning.selection_privacy import TrialCount

        start = time.perf_counter()
        best_p, trainer = search(data, os.path.join(args.output_dir, "private"), args.epsilon, args.delta, None,
                                 "private", args.private_gamma, args.features, args.norms)
        import csv

        with open(os.path.join(args.output_dir, "private", "hp_search_trials.csv")) as f:
            row = next(csv.DictReader(f), {})
        report["private_mode"] = {
            "trial_count": TrialCount.geometric(args.private_gamma).describe(),
            "epsilon_per_trial": args.epsilon, "epsilon_search_total": float(row.get("epsilon_search_total") or "nan"),
            "best_params": None if best_p is None else best_p.hyperparameters,
            "best_val_accuracy": None if best_p is None else best_p.objective,
            "test_accuracy": None if best_p is None else trainer.evaluate(FeatureSet(*data["test"]))["eval_accuracy"],
            "seconds": time.perf_counter() - start}
        print(f"private-mode search: {report['private_mode']}", flush=True)
    report["load_after"] = os.getloadavg()
    with open(os.path.join(args.output_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
