"""End to end: a tiny ViT trained with DPTrainer on sklearn's digits at ε = 8 learns (CPU, under a minute)."""

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.tiny import tiny_vit


def test_tiny_vit_on_digits_at_epsilon_8(digits, tmp_path):
    args = DPTrainingArguments(
        output_dir=str(tmp_path), target_epsilon=8.0, target_delta=1e-4, per_device_train_batch_size=64,
        num_train_epochs=12, learning_rate=1e-2, per_sample_max_grad_norm=1.0, report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )
    trainer = DPTrainer(model=tiny_vit(), args=args, train_dataset=digits["train"], eval_dataset=digits["test"],
                        compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())})
    out = trainer.train()
    assert 7.9 <= out.metrics["epsilon"] <= 8.0
    assert trainer.evaluate()["eval_accuracy"] > 0.5  # chance is 0.1
