"""Mixed precision: the pure decision (e31.recipes.precision.plan) and, where a GPU is, the
recipes' autocast and loss scaling as it decides them."""

import pytest
import torch

from e31.recipes import precision
from e31.recipes.precision import PRECISIONS, Plan, plan

pytestmark = pytest.mark.nodb


def test_on_cuda_each_precision_has_its_autocast_and_only_fp16_scales_the_loss():
    assert plan("fp32", "cuda") == Plan(None, False, None)
    assert plan("bf16", "cuda") == Plan("bfloat16", False, None)
    assert plan("fp16", "cuda") == Plan("float16", True, None)


def test_not_choosing_keeps_what_the_recipes_always_did():
    assert plan("", "cuda") == plan("bf16", "cuda")
    assert plan("", "cpu") == Plan(None, False, None)


def test_on_the_cpu_every_precision_runs_fp32_and_a_half_one_asked_is_said():
    for asked in ("", *PRECISIONS):
        assert plan(asked, "cpu")[:2] == (None, False)
    assert plan("bf16", "cpu").note == "precision bf16 asked: a no-op on the CPU, running fp32"
    assert plan("fp16", "cpu").note == "precision fp16 asked: a no-op on the CPU, running fp32"
    assert plan("fp32", "cpu").note is None


@pytest.mark.parametrize("bad", ["fp8", "BF16", " bf16", "float16", None, 16])
def test_anything_else_is_refused_naming_the_choices(bad):
    assert "choose fp32, bf16 or fp16" in precision.problem(bad)
    with pytest.raises(ValueError, match="is not a precision: choose fp32, bf16 or fp16"):
        plan(bad, "cuda")


def test_the_choices_are_the_precisions_and_the_default():
    assert [value for value, _ in precision.CHOICES] == ["", *PRECISIONS]
    assert all(precision.problem(value) is None for value, _ in precision.CHOICES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("asked", "dtype", "scaled"), [("bf16", torch.bfloat16, False), ("fp16", torch.float16, True), ("fp32", torch.float32, False), ("", torch.bfloat16, False)]
)
def test_on_a_gpu_the_recipes_autocast_and_scale_as_planned(monkeypatch, asked, dtype, scaled):
    from e31.recipes import common

    monkeypatch.setenv("E31_PRECISION", asked)
    device = torch.device("cuda", 0)
    layer = torch.nn.Linear(8, 8).to(device)
    with common.autocast(device):
        out = layer(torch.randn(4, 8, device=device))
    assert out.dtype == dtype
    assert common.precision_plan(device).scaler is scaled
    # A step the way fit() takes it: the weights stay float32 and move.
    scaler = torch.amp.GradScaler("cuda", enabled=scaled)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    before = layer.weight.detach().clone()
    scaler.scale(out.float().pow(2).mean()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert layer.weight.dtype == torch.float32 and not torch.equal(layer.weight, before)
