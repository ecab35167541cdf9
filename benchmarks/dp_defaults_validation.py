"""How the image DP-aware defaults' learning-rate scale and the feature maps it was compared with were chosen
(issue 40 item 2): the rule's probe (`hf_dp_repr.scripts.dp_defaults`: expected batch n/4, 40 epochs, SGD, automatic
clipping, zero head, δ = 1e-5) on cached DINOv2-S [CLS | mean patch] features, trained on the seed-000 proxy's private
1000 and scored on its held-out "val" rows (`seed000_proxy_tuning.py --stage features --max_val 1000` first). The
test split is never read here. Not a test; prints one JSON line per setting.

    export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
    python benchmarks/dp_defaults_validation.py --maps raw --lr_scales 0.314 1 3.2 --runs 3   # ×0.314: the grey scale
    python benchmarks/dp_defaults_validation.py --maps unln grey_centre l2 synthetic:standardize public:pca:32

Maps in front of the head (all but `public:` data-free): raw; unln (x − β) / |γ| with the final LayerNorm's β, γ;
grey_centre (x − the grey image's x); l2 (per example); synthetic:P (`probe_preconditioning` P fitted on 192 images
of smooth random colours made from a fixed seed, no data); public:P (fitted on the 1000 held-out "tune" images,
labels unused: public images the user would need). The learning rate is 0.9·ε / s × `--lr_scales`, s the distance
between a black and a white image's mapped head inputs (the rule's scale; for l2, 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import warnings

import numpy as np
import seed000_proxy_tuning as s0  # benchmarks/, the script's folder, is on sys.path
import torch


def head_inputs(model, images: list) -> torch.Tensor:
    """[CLS | mean patch] of uint8 HWC images, or of (3, 224, 224) pixel values, as the recipe's head reads them."""
    from hf_dp_repr.data.images import image_processor_for

    if isinstance(images, torch.Tensor):
        pixels = images
    else:
        processor, _ = image_processor_for(s0.MODEL, model.config, image_size=224)
        pixels = processor(images, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        hidden = model(pixel_values=pixels).last_hidden_state
    return torch.cat([hidden[:, 0], hidden[:, 1:].mean(1)], 1)


def public_constants() -> dict:
    """Data-free: the final LayerNorm's γ, β; the head inputs of a black, a white and a grey image; of 192 smooth
    random-colour images (a fixed seed)."""
    from PIL import Image
    from transformers import AutoModel

    model = AutoModel.from_pretrained(s0.MODEL, dtype=torch.float32).eval()
    black, white = (np.full((32, 32, 3), v, np.uint8) for v in (0, 255))
    rng = np.random.default_rng(0)
    synthetic = [np.asarray(Image.fromarray(rng.integers(0, 256, (k, k, 3), dtype=np.uint8)).resize((32, 32),
                                                                                                  Image.BICUBIC))
                 for k in [2, 4, 8] * 64]
    return {"gamma": model.layernorm.weight.detach().repeat(2), "beta": model.layernorm.bias.detach().repeat(2),
            "black_white": head_inputs(model, [black, white]), "grey": head_inputs(model, torch.zeros(1, 3, 224, 224)),
            "synthetic": torch.cat([head_inputs(model, synthetic[i:i + 32]) for i in range(0, 192, 32)])}


class Probe(torch.nn.Module):
    """A fixed map, then the linear head (shaped like an HF classifier: DPTrainer reads `.logits`)."""

    def __init__(self, name: str, const: dict, tune: torch.Tensor):
        super().__init__()
        from hf_dp_repr.scope.preconditioning import fit_preconditioner

        self.name, self.pre = name, None
        self.shift, self.scale = torch.zeros(768), torch.ones(768)
        if name.startswith(("synthetic:", "public:")):
            source, spec = name.split(":", 1)
            self.pre = fit_preconditioner(const["synthetic"] if source == "synthetic" else tune, spec)
        elif name == "unln":
            self.shift, self.scale = const["beta"], const["gamma"].abs()
        elif name == "grey_centre":
            self.shift = const["grey"][0]
        self.classifier = torch.nn.Linear(self.map(torch.zeros(1, 768)).shape[1], 10)
        torch.nn.init.zeros_(self.classifier.weight)  # the rule's head_init="zeros"
        torch.nn.init.zeros_(self.classifier.bias)

    def map(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre is not None:
            return self.pre(x)
        x = (x - self.shift) / self.scale
        return x / x.norm(dim=-1, keepdim=True) if self.name == "l2" else x

    def forward(self, features, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.classifier(self.map(features))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def run(data, probe: Probe, const: dict, epsilon: float, lr_scale: float, tmp: str) -> tuple[float, float, float]:
    """(val accuracy, learning rate, s) of one run with a fresh secret."""
    from hf_dp_repr import DPTrainer, DPTrainingArguments

    with torch.no_grad():
        bw = probe.map(const["black_white"])
    s = 1.0 if probe.name == "l2" else float((bw[1] - bw[0]).norm())
    lr = min(8.0, 0.9 * epsilon) / s * lr_scale
    args = DPTrainingArguments(output_dir=tmp, target_epsilon=epsilon, target_delta=1e-5, optim="sgd", learning_rate=lr,
                               per_device_train_batch_size=250, num_train_epochs=40, clipping="automatic",
                               report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
                               disable_tqdm=True, per_device_eval_batch_size=4096, dataloader_pin_memory=False)
    trainer = DPTrainer(model=probe, args=args, train_dataset=s0.FeatureSet(*data["private"]),
                        eval_dataset=s0.FeatureSet(*data["val"]), compute_metrics=s0.accuracy)
    trainer.train()
    return trainer.evaluate()["eval_accuracy"], lr, s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", nargs="+", default=["raw"])
    parser.add_argument("--lr_scales", nargs="+", type=float, default=[1.0])
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    data = s0.load_features()
    const = public_constants()
    tune = torch.tensor(data["tune"][0])
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.maps:
            for lr_scale in args.lr_scales:
                out = [run(data, Probe(name, const, tune), const, args.epsilon, lr_scale, tmp)
                       for _ in range(args.runs)]
                accs = [100 * a for a, _, _ in out]
                print(json.dumps({"map": name, "epsilon": args.epsilon, "lr_scale": lr_scale, "s": round(out[0][2], 3),
                                  "learning_rate": round(out[0][1], 4), "val_mean": round(statistics.mean(accs), 1),
                                  "val_sd": round(statistics.stdev(accs), 1) if len(accs) > 1 else 0.0,
                                  "runs": [round(a, 1) for a in accs]}), flush=True)


if __name__ == "__main__":
    main()
