"""Hutchinson tr(H), HessianTraceCallback, and public → private continual training in one DPTrainer.train()."""

import math
import os

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.tiny import tiny_vit
from hf_dp_repr.training.continual.curvature import HessianTraceCallback, hutchinson_trace, model_trace, public_batch
from hf_dp_repr.training.continual.public_phase import RECORD_FILE, load_record


def hutchinson_tolerance(hessian: torch.Tensor, probes: int, k: float = 5.0) -> float:
    """k standard deviations of the mean of `probes` Rademacher estimates: Var[vᵀHv] = 2(‖H‖_F² − Σ H_ii²) exactly
    for symmetric H, so by Chebyshev |estimate − tr(H)| > k·sd has probability ≤ 1/k² (4 % for k = 5) whatever the
    seed, and ≈ 6e-7 under the CLT."""
    variance = 2 * ((hessian ** 2).sum() - (torch.diagonal(hessian) ** 2).sum()).item()
    return k * math.sqrt(variance / probes)


def test_hutchinson_matches_the_exact_trace_of_a_small_mlp():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    w1, w2 = torch.randn(5, 4, generator=gen, requires_grad=True), torch.randn(3, 5, generator=gen, requires_grad=True)

    def loss_of(a, b):
        return torch.nn.functional.cross_entropy(torch.tanh(x @ a.T) @ b.T, y)

    flat = torch.cat([w1.detach().flatten(), w2.detach().flatten()])
    exact = torch.autograd.functional.hessian(lambda v: loss_of(v[:20].view(5, 4), v[20:].view(3, 5)), flat)
    probes = 4000
    estimate, stderr = hutchinson_trace(lambda: loss_of(w1, w2), [w1, w2], probes, torch.Generator().manual_seed(1))
    tolerance = hutchinson_tolerance(exact, probes)
    assert abs(estimate - torch.trace(exact).item()) <= tolerance
    assert tolerance < 0.5 * abs(torch.trace(exact).item())  # tight enough to catch e.g. a factor-2 or sign error
    assert stderr == pytest.approx(tolerance / 5, rel=0.5)  # the reported standard error is the sd of the mean


def test_model_trace_of_an_hf_head_matches_the_exact_hessian(digits):
    """tr(H) of tiny ViT's loss over its classifier (the backbone frozen), in eval mode, vs the exact Hessian."""
    model = tiny_vit(num_labels=10, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("classifier"))
    batch = public_batch(digits["test"], 32)
    model.eval()
    with torch.no_grad():
        features = model.vit(pixel_values=batch["pixel_values"]).last_hidden_state[:, 0]
    head = model.classifier
    shapes = [head.weight.shape, head.bias.shape]

    def loss_of(v):
        w, b = v[:shapes[0].numel()].view(shapes[0]), v[shapes[0].numel():]
        return torch.nn.functional.cross_entropy(features @ w.T + b, batch["labels"])

    exact = torch.autograd.functional.hessian(loss_of, torch.cat([head.weight.detach().flatten(), head.bias.detach()]))
    model.train()
    estimate, _ = model_trace(model, batch, num_probes=200, generator=torch.Generator().manual_seed(0))
    assert model.training  # the mode is restored
    assert abs(estimate - torch.trace(exact).item()) <= hutchinson_tolerance(exact, 200)


def test_hessian_trace_callback_logs_with_a_plain_trainer(digits, tmp_path):
    cb = HessianTraceCallback(digits["test"], every_n_steps=2, num_probes=2, max_examples=16)
    args = TrainingArguments(str(tmp_path), max_steps=4, report_to="none", save_strategy="no", disable_tqdm=True,
                             logging_steps=100)
    trainer = Trainer(model=tiny_vit(num_labels=10), args=args, train_dataset=digits["train"], callbacks=[cb])
    trainer.train()
    assert [s for s, _, _ in cb.history] == [1, 2, 4]
    logged = [e for e in trainer.state.log_history if "hessian_trace" in e]
    assert [e["step"] for e in logged] == [1, 2, 4] and all(math.isfinite(e["hessian_trace"]) for e in logged)


def test_hessian_trace_callback_refuses_the_private_set(digits, tmp_path):
    private = digits["train"].select(range(64))
    args = DPTrainingArguments(str(tmp_path), target_epsilon=8.0, report_to="none")
    with pytest.raises(ValueError, match="private training set"):
        DPTrainer(model=tiny_vit(num_labels=10), args=args, train_dataset=private,
                  callbacks=[HessianTraceCallback(private)])


class Snapshot(TrainerCallback):
    """The weights when the DP phase begins (= after the public phase)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}


def continual_run(digits, tmp_path, name="run", public=True, resume=None, **kw):
    data = digits["train"]
    settings = dict(output_dir=str(tmp_path / name), target_epsilon=8.0, target_delta=1e-4,
                    per_device_train_batch_size=32, max_steps=4, learning_rate=3e-3, report_to="none",
                    save_strategy="no", disable_tqdm=True, noise_seed=5, seed=0)
    if public:
        settings.update(public_max_steps=6, public_check_steps=3, hessian_probes=2, hessian_max_examples=16)
    settings.update(kw)
    args = DPTrainingArguments(**settings)
    snap = Snapshot()
    model = tiny_vit(num_labels=10, seed=0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=args, train_dataset=data.select(range(400, 1000)), callbacks=[snap],
                        public_train_dataset=data.select(range(400)) if public else None,
                        public_eval_dataset=digits["test"].select(range(64)) if public else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, start, snap.weights


def moved(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_fixed_switch_trains_both_phases_and_accounts_only_private_steps(digits, tmp_path):
    trainer, start, at_switch = continual_run(digits, tmp_path)
    end = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert moved(start, at_switch) > 1e-4 and moved(at_switch, end) > 1e-4  # both phases trained
    record = trainer.continual_record
    assert record["switch_step"] == 6 and record["private_steps"] == 4
    # the ledger, σ, q and the Poisson batches are those of the same DP run without a public phase
    alone, _, _ = continual_run(digits, tmp_path, name="alone", public=False)
    assert trainer.ledger.to_dict() == alone.ledger.to_dict() and trainer.ledger.steps_done == 4
    for s in (trainer.engine.sampler, alone.engine.sampler):
        s.set_epoch(0)
    assert list(trainer.engine.sampler) == list(alone.engine.sampler)
    # tr(H), the decelerator and ε over time, saved and plotted
    public = [h for h in record["history"] if h["phase"] == "public"]
    private = [h for h in record["history"] if h["phase"] == "private"]
    assert [h["step"] for h in public] == [1, 3, 6] and all("decelerator" in h for h in public)
    assert [h["step"] for h in private] == [6 + 3] and 0 < private[0]["epsilon"] < record["epsilon"] <= 8.0
    out = tmp_path / "run"
    assert load_record(str(out))["switch_step"] == 6 and os.path.getsize(out / "continual_training.png") > 1000


def test_resume_across_the_switch_gives_the_same_ledger(digits, tmp_path, caplog):
    full, _, _ = continual_run(digits, tmp_path, name="full")
    continual_run(digits, tmp_path, name="cut", save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "cut" / "checkpoint-2"
    assert (checkpoint / RECORD_FILE).exists()
    caplog.clear()
    with caplog.at_level("WARNING"):
        resumed, _, _ = continual_run(digits, tmp_path, name="cut", save_strategy="steps", save_steps=2,
                                      resume=str(checkpoint))
    assert "resuming after the switch" in caplog.text and "public step" not in caplog.text  # not re-run
    assert resumed.ledger.to_dict() == full.ledger.to_dict()
    assert resumed.continual_record["switch_step"] == 6


def test_decelerator_switch_stops_at_the_first_small_ratio(digits, tmp_path):
    trainer, _, _ = continual_run(digits, tmp_path, public_switch="decelerator", public_max_steps=9,
                                  decelerator_threshold=1.0, public_check_steps=3)
    public = [h for h in trainer.continual_record["history"] if h["phase"] == "public"]
    ratios = [h["decelerator_ratio"] for h in public]
    switch = trainer.continual_record["switch_step"]
    assert all(r > 1.0 for r in ratios[:-1])
    assert ratios[-1] <= 1.0 or switch == 9  # stopped at the first small ratio, or ran out of public steps
    for h in public:  # D / ḡᵀHḡ with D = σ²C²tr(H)/B², tr(H) at its upper 2-standard-error end
        led = trainer.ledger.plan.phases[0]
        d = led.noise_multiplier ** 2 * max(0, h["hessian_trace"] + 2 * h["hessian_trace_stderr"]) \
            / led.expected_batch_size ** 2
        want = d / h["curvature_along_gradient"] if h["curvature_along_gradient"] > 0 else math.inf
        assert h["decelerator_ratio"] == pytest.approx(want)


def test_curvature_along_the_clipped_gradient_matches_a_finite_difference():
    """ḡᵀHḡ from clipped_gradient_terms against (Gᵀḡ at w + εḡ − at w − εḡ) / 2ε on a tiny linear regression."""
    from hf_dp_repr.training.continual.curvature import clipped_gradient_terms

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x, labels):
            return type("Out", (), {"loss": ((torch.tanh(self.lin(x)).squeeze(-1) - labels) ** 2).mean()})()

    torch.manual_seed(0)
    model = Tiny().double()  # float64: the finite difference is then accurate to ~1e-7
    batch = {"x": torch.randn(6, 3, dtype=torch.float64), "labels": torch.randn(6, dtype=torch.float64)}
    first, along = clipped_gradient_terms(model, batch, max_grad_norm=0.3)
    clipped = []
    for i in range(6):
        grads = torch.autograd.grad(model(batch["x"][i:i + 1], batch["labels"][i:i + 1]).loss, list(model.parameters()))
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        clipped.append([g * min(1.0, 0.3 / norm.item()) for g in grads])
    g_bar = [sum(c[j] for c in clipped) / 6 for j in range(2)]

    def grad_dot(shift):
        with torch.no_grad():
            for p, d in zip(model.parameters(), g_bar):
                p.add_(shift * d)
        full = torch.autograd.grad(model(**batch).loss, list(model.parameters()))
        with torch.no_grad():
            for p, d in zip(model.parameters(), g_bar):
                p.sub_(shift * d)
        return sum((f * d).sum() for f, d in zip(full, g_bar)).item()

    assert first == pytest.approx(grad_dot(0.0), rel=1e-5)
    assert along == pytest.approx((grad_dot(1e-4) - grad_dot(-1e-4)) / 2e-4, rel=1e-5)


def test_plateau_switch_watches_the_public_eval_loss(digits, tmp_path):
    trainer, _, _ = continual_run(digits, tmp_path, public_switch="plateau", public_plateau_patience=1,
                                  public_max_steps=12, public_check_steps=2, learning_rate=0.5)
    losses = [h for h in trainer.continual_record["history"] if "public_eval_loss" in h]
    assert losses and losses[-1]["step"] == trainer.continual_record["switch_step"]
    if trainer.continual_record["switch_step"] < 12:
        assert losses[-1]["public_eval_loss"] >= min(h["public_eval_loss"] for h in losses[:-1]) - 1e-4


@pytest.mark.parametrize("kw, public, match", [
    (dict(public_max_steps=3), None, "no public_train_dataset"),
    (dict(), "same", "is the private train_dataset"),
    (dict(public_max_steps=3, public_switch="plateau"), "other", "needs a public_eval_dataset"),
    (dict(), "other", "needs public_max_steps >= 1"),
])
def test_public_phase_refusals(kw, public, match, digits, tmp_path):
    private = digits["train"].select(range(64))
    other = {"same": private, "other": digits["train"].select(range(64, 128)), None: None}[public]
    args = DPTrainingArguments(str(tmp_path / "x"), target_epsilon=8.0, report_to="none", **kw)
    with pytest.raises(ValueError, match=match):
        DPTrainer(model=tiny_vit(num_labels=10), args=args, train_dataset=private, public_train_dataset=other)


def test_curvature_estimates_leave_the_dp_steps_unchanged(digits, tmp_path):
    """The Hessian-vector products run with the per-sample hooks paused: the same seeded DP run with and without
    a HessianTraceCallback ends with the same weights."""
    weights = []
    for name, callbacks in (("plain", []), ("probed", [HessianTraceCallback(digits["test"], every_n_steps=1,
                                                                            num_probes=2, max_examples=8)])):
        args = DPTrainingArguments(str(tmp_path / name), target_epsilon=8.0, target_delta=1e-4,
                                   per_device_train_batch_size=32, max_steps=3, learning_rate=3e-3, report_to="none",
                                   save_strategy="no", disable_tqdm=True, noise_seed=2, seed=0)
        trainer = DPTrainer(model=tiny_vit(num_labels=10, seed=0), args=args,
                            train_dataset=digits["train"].select(range(600)), callbacks=callbacks)
        trainer.train()
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    assert moved(*weights) < 1e-6
    assert [s for s, _, _ in callbacks[0].history] == [1, 2, 3]
