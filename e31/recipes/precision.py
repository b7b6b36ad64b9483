"""Mixed precision: what a job's precision ($E31_PRECISION) asks of the device a recipe runs on.

Pure: neither torch nor Django. The recipes (common.py) turn a plan into torch.autocast and a
GradScaler; the web app takes its choices from here. Not chosen ("") keeps what the recipes
always did: bf16 autocast on CUDA, float32 on the CPU (where autocast would make runs differ
from one machine to the next for little gain).
"""

from typing import NamedTuple

PRECISIONS = ("fp32", "bf16", "fp16")
CHOICES = (
    ("", "Default (the recipes: bf16 on GPUs, fp32 on the CPU)"),
    ("fp32", "fp32: full precision, no autocast"),
    ("bf16", "bf16: bfloat16 autocast on GPUs"),
    ("fp16", "fp16: float16 autocast with loss scaling on GPUs"),
)


class Plan(NamedTuple):
    """How to compute: the autocast dtype's name in torch ("bfloat16", "float16"; None: no
    autocast), whether the loss needs scaling (fp16's GradScaler), and a line for the log when
    what runs is not what was asked (None when it is)."""

    autocast: str | None
    scaler: bool
    note: str | None


def problem(precision: str) -> str | None:
    """Why precision is not one a job may ask for (None when it may)."""
    if precision in ("", *PRECISIONS):
        return None
    return f"{precision!r} is not a precision: choose fp32, bf16 or fp16 (or none, for the default)"


def plan(precision: str, device_type: str) -> Plan:
    """The plan for precision ("", "fp32", "bf16" or "fp16") on a device of device_type
    ("cuda", "cpu"); raises ValueError for another precision."""
    if (error := problem(precision)) is not None:
        raise ValueError(error)
    if device_type != "cuda":
        where = "the CPU" if device_type == "cpu" else device_type
        note = f"precision {precision} asked: a no-op on {where}, running fp32" if precision in ("bf16", "fp16") else None
        return Plan(None, False, note)
    if precision == "fp32":
        return Plan(None, False, None)
    if precision == "fp16":
        return Plan("float16", True, None)
    return Plan("bfloat16", False, None)  # bf16, or not chosen: what the recipes always did on CUDA
