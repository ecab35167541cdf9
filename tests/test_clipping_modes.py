"""The clipping-mode registry (hf_dp_repr/privacy/clipping_modes.py): every private mode bounds each example by C;
the arguments accept exactly the registered modes; a registration is all a new mode needs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dp_repr import DPTrainingArguments
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.privacy.clipping_modes import CLIPPING_MODES, clip_factors, register_clipping_mode
from hf_dp_repr.privacy.optimizer import MicroBatchDPOptimizer
from hf_dp_repr.privacy.randomness import DPRandomness

PRIVATE = [name for name, mode in CLIPPING_MODES.items() if mode.private]

# per-example gradients (examples × tensors × coordinates), from tiny to huge, with all-zero examples
gradients = st.tuples(st.integers(1, 6), st.integers(1, 5), st.integers(1, 4),
                      st.floats(-12, 8), st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("mode", PRIVATE)
@settings(max_examples=60, deadline=None)
@given(shape=gradients, max_grad_norm=st.floats(1e-3, 1e3))
def test_every_private_mode_bounds_each_example_by_c(mode, shape, max_grad_norm):
    examples, tensors, size, log_scale, seed = shape
    g = torch.randn(examples, tensors, size, generator=torch.Generator().manual_seed(seed)) * 10.0 ** log_scale
    g[0] = 0.0  # an example with no gradient
    factors = clip_factors(mode, g.norm(dim=2), max_grad_norm)
    clipped = (factors[:, :, None] * g).flatten(1).norm(dim=1)
    assert factors.shape == (examples, tensors) and bool(torch.isfinite(factors).all())
    assert bool((clipped <= max_grad_norm * (1 + 1e-5)).all()), (mode, clipped.max().item(), max_grad_norm)


def test_the_reference_mode_is_registered_not_private_and_refused_with_noise():
    assert PRIVATE == ["flat", "per_layer", "automatic"] and not CLIPPING_MODES["none"].private
    with pytest.raises(DPConfigError, match="clipping='none' bounds no example's influence"):
        DPTrainingArguments(output_dir="o", report_to="none", target_epsilon=1.0, clipping="none")


def test_one_registration_makes_a_mode_usable_and_its_privacy_flag_is_enforced(tmp_path):
    with pytest.raises(DPConfigError, match=r"unknown clipping 'quarter'; use one of \('flat', 'per_layer'"):
        DPTrainingArguments(output_dir=str(tmp_path), report_to="none", target_epsilon=1.0, clipping="quarter")

    @register_clipping_mode("quarter", help="flat clipping to C/4")
    def quarter(norms, max_grad_norm):
        return (max_grad_norm / 4 / (norms.norm(2, dim=1, keepdim=True) + 1e-6)).clamp(max=1.0).expand_as(norms)

    register_clipping_mode("unbounded_test", private=False)(lambda norms, c: torch.ones_like(norms))
    try:
        args = DPTrainingArguments(output_dir=str(tmp_path), report_to="none", target_epsilon=1.0, clipping="quarter")
        assert args.clipping == "quarter"
        optimizer = MicroBatchDPOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0),
                                          clipping="quarter", noise_multiplier=0.0, max_grad_norm=2.0,
                                          expected_batch_size=1, noise_generator=DPRandomness().noise_generator)
        torch.testing.assert_close(optimizer.clip_factors(torch.tensor([[3.0, 4.0]])), torch.full((1, 2), 0.1))
        with pytest.raises(DPConfigError, match="clipping='unbounded_test' bounds no example's influence"):
            DPTrainingArguments(output_dir=str(tmp_path), report_to="none", target_epsilon=1.0,
                                clipping="unbounded_test")
        with pytest.raises(ValueError, match="already registered"):
            register_clipping_mode("quarter")(quarter)
    finally:
        del CLIPPING_MODES["quarter"], CLIPPING_MODES["unbounded_test"]
