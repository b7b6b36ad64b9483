"""What the recipes share: configuration, device and DDP, LoRA, weights in and out, the loop.

The environment a recipe reads (besides the SDK's, see e31/__init__.py):
E31_MODEL_DIR   models the network staged for the job. In train mode, start/ (when present) is
                the model to fine-tune; in evaluate mode every subfolder is a model to score.
                A model folder holds model.safetensors (or a torch state dict *.pt / *.pth)
                and recipe.json, written by an earlier run of the same recipe.
E31_PRECISION   fp32, bf16 or fp16 (unset: bf16 on CUDA): autocast on CUDA, fp16 with loss
                scaling; on the CPU the recipes run fp32 whatever it says, and the log says so.
E31_EARLY_STOP_METRIC, E31_EARLY_STOP_MODE
                the metric the network watches to stop the run early, and its mode: the run
                checkpoints at each new best of it and, stopped on it (the stop notice says so,
                see e31/best.py), returns the weights of its best step.
What a training run writes to $E31_OUTPUT_DIR: model.safetensors (plain weights; LoRA adapters
merged in), recipe.json (architecture and data description), adapters.safetensors (LoRA only)
and metrics.json (the final evaluation); when early stopping (its own, or the network's on the
metric it watches) went back to better weights, the last ones in last/. An evaluation run writes
evaluation.json.

It stays one file, over 500 lines, because fit() ties the rest together (the configuration, Dist,
LoRA, the weights in and out, checkpoints and the network's early stopping) and a recipe is
written as calls into this one module: split, fit() would import nearly every part back, and
each recipe would import several modules for one run.
"""

import contextlib
import copy
import gc
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar, cast, overload

import torch
from torch import nn

import e31
from e31 import best as returned
from e31.best import Point
from e31.recipes import precision, validate

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import FSDPModule

Config = dict[str, Any]  # a recipe's configuration, as validate() fills it
Metrics = dict[str, float]  # an evaluation: {"val_loss": ..., ...}
MetricWatch = tuple[str, str]  # (metric, mode) the network watches: see network_watch()
M = TypeVar("M", bound=nn.Module)  # a recipe's model class

FORMAT = 1
SMOKE_STEPS = 5
SMOKE_FRACTION = 0.01


def fail(message: object) -> NoReturn:
    """End the run with a one-line error (exit status 1)."""
    raise SystemExit(f"error: {' '.join(str(message).split())}")


# -- configuration ----------------------------------------------------------------------------


def load_config(recipe_name: str) -> Config:
    """The job's configuration ($E31_CONFIG, {} when unset) checked and filled by validate()."""
    path = os.environ.get("E31_CONFIG")
    raw: object = {}
    if path and Path(path).exists():
        text = Path(path).read_text().strip()
        try:
            raw = json.loads(text) if text else {}
        except json.JSONDecodeError as error:
            fail(f"$E31_CONFIG is not valid JSON: {error}")
    clean, errors = validate(recipe_name, raw)
    if errors:
        fail("bad configuration: " + "; ".join(errors.values()))
    if clean["smoke"]:
        clean["max_steps"] = min(clean["max_steps"], SMOKE_STEPS)
        clean["eval_every"] = min(clean["eval_every"], clean["max_steps"])
    return clean


def smoke_count(total: int, at_least: int) -> int:
    """How many training examples a smoke run keeps: 1%, but at least one batch."""
    return min(total, max(math.ceil(total * SMOKE_FRACTION), at_least))


def output_dir() -> Path:
    folder = Path(os.environ.get("E31_OUTPUT_DIR") or "output")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def data_dir() -> Path:
    return Path(os.environ.get("E31_DATA_DIR") or "data")


def model_dir() -> Path | None:
    value = os.environ.get("E31_MODEL_DIR")
    return Path(value) if value else None


def start_dir() -> Path | None:
    """$E31_MODEL_DIR/start when it exists: the model a training run fine-tunes."""
    folder = model_dir()
    return folder / "start" if folder is not None and (folder / "start").is_dir() else None


# -- device and DDP ---------------------------------------------------------------------------


def pick_device(local_rank: int = 0) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def precision_plan(device: torch.device) -> precision.Plan:
    """The job's precision ($E31_PRECISION: fp32, bf16, fp16; unset: bf16 on CUDA) on device,
    as precision.plan() decides it."""
    try:
        return precision.plan(os.environ.get("E31_PRECISION", "").strip(), device.type)
    except ValueError as error:
        fail(f"$E31_PRECISION: {error}")


def autocast(device: torch.device) -> AbstractContextManager[object]:
    """Autocast as the job's precision asks on CUDA; nothing on the CPU (float32 there keeps
    runs reproducible)."""
    dtype = precision_plan(device).autocast
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


class Dist:
    """The process group when torchrun started several processes (WORLD_SIZE > 1), else a no-op.

    parallel is "ddp" (each process holds the whole model) or "fsdp" (FSDP2's fully_shard: each
    process holds a shard of the parameters, gradients and optimizer state). With one process
    both are the plain model. Under FSDP, model_state() and load_model_state() (and their
    optimizer twins) are collectives: every process calls them at the same point of the run.
    """

    def __init__(self, parallel: str = "ddp") -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.rank = int(os.environ.get("RANK", "0") or 0)
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self.device = pick_device(local_rank)
        self.active = self.world > 1
        self.parallel = parallel
        self.sharded = self.active and parallel == "fsdp"
        if self.active:
            import torch.distributed as distributed

            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            distributed.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        if not self.active:
            return f"1 process on {self.device.type}"
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        kind = "fully sharded data parallel (FSDP2)" if self.sharded else "data parallel"
        return f"{kind}: {self.world} processes on {self.device.type} ({backend})"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train: model itself (sharded in place under FSDP), or a DDP wrapper of it."""
        if not self.active:
            return model
        if self.sharded:
            import warnings

            from torch.distributed.fsdp import fully_shard

            # The logits are a view (nn.Linear over 3-d input); nothing edits them in place.
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

            # One shard group per block of each ModuleList (a transformer's layers), so only one
            # block is gathered at a time; the root group holds the rest (embeddings, head).
            for module in list(model.modules()):
                if isinstance(module, nn.ModuleList):
                    for block in module:
                        fully_shard(block)
            # model itself, its class now a subclass of both FSDPModule and its own nn.Module class.
            return cast(nn.Module, fully_shard(model))
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This process's part of a global batch (every process draws the same global batch)."""
        return indices[self.rank :: self.world] if self.active else indices

    def any(self, flag: object) -> bool:
        """True when flag is true in any process, so all of them stop at the same step."""
        if not self.active:
            return bool(flag)
        import torch.distributed as distributed

        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        distributed.all_reduce(value, op=distributed.ReduceOp.MAX)
        return bool(value.item())

    # The state of a model or optimizer, gathered to whole tensors: rank 0 gets it (on the CPU),
    # the other processes an empty dict under FSDP. Loading takes rank 0's and shards it.
    # An FSDP run's optimizer state is keyed by parameter name, with any number of processes,
    # so its checkpoint resumes whether the restart has one process or several.

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        if not self.sharded:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=self._gather())

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.parallel != "fsdp":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=self._gather() if self.sharded else None)

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        if not self.sharded:
            model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        cast("FSDPModule", model).reshard()  # after a forward pass the root's parameters are still whole; loading needs shards
        set_model_state_dict(model, state, options=self._scatter())

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        by_name = any(isinstance(key, str) for key in state.get("state", {}))
        if not (self.sharded or by_name):
            return optimizer.load_state_dict(state)
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if self.sharded:
            cast("FSDPModule", model).reshard()
        set_optimizer_state_dict(model, optimizer, state, options=self._scatter() if self.sharded else None)

    @staticmethod
    def _gather() -> "StateDictOptions":
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    @staticmethod
    def _scatter() -> "StateDictOptions":
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def close(self, finished: bool = False) -> None:
        """Leave the process group. A finished run first waits for every process to finish: a
        process whose peers have already torn their side down can abort in gloo's teardown
        (rank 0 still writes the weights when the others are done). A failed run does not wait,
        since a peer may never arrive. What the run made in cycles (an FSDP model's sharded
        parameters hold the group through their device mesh) is collected first, while the group
        is there, so the group ends here rather than in the interpreter's teardown."""
        if not self.active:
            return
        import torch.distributed as distributed

        if not distributed.is_initialized():
            return
        gc.collect()
        if finished:
            distributed.barrier()
        distributed.destroy_process_group()


# -- LoRA -------------------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: y = base(x) + (alpha/rank) x A^T B^T.

    B starts at zero, so the wrapped layer starts equal to the base layer.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        for parameter in base.parameters():
            parameter.requires_grad_(False)
        self.rank, self.alpha = int(rank), float(alpha)
        self.scale = self.alpha / self.rank
        weight = base.weight
        self.lora_A = nn.Parameter(torch.empty(self.rank, base.in_features, dtype=weight.dtype, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, self.rank, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale

    def delta(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A) * self.scale

    def merged(self) -> nn.Linear:
        """A plain nn.Linear with the update folded into its weight."""
        base = self.base
        linear = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device=base.weight.device, dtype=base.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(base.weight + self.delta().to(base.weight.dtype))
            if base.bias is not None:
                linear.bias.copy_(base.bias)
        return linear


def apply_lora(model: nn.Module, rank: int, alpha: float) -> list[LoRALinear]:
    """Freeze every parameter of model and wrap each nn.Linear in it in a LoRALinear (in place).

    Returns the list of adapter modules; only their lora_A and lora_B train.
    """
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    adapters: list[LoRALinear] = []
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        adapter = LoRALinear(linear, rank, alpha)
        _set_submodule(model, name, adapter)
        adapters.append(adapter)
    return adapters


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' parameters: {"<linear's path>.lora_A": ..., "<...>.lora_B": ...}."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


def merge_lora(model: nn.Module) -> nn.Module:
    """A copy of model with every LoRALinear replaced by a plain nn.Linear of weight W + (alpha/rank) B A:
    the base architecture, the same outputs. model itself is left as it is."""
    merged = copy.deepcopy(model)
    targets = [(name, m) for name, m in merged.named_modules() if isinstance(m, LoRALinear)]
    for name, adapter in targets:
        if name:
            _set_submodule(merged, name, adapter.merged())
        else:
            merged = adapter.merged()
    for parameter in merged.parameters():
        parameter.requires_grad_(True)
    return merged


# -- weights in and out -----------------------------------------------------------------------


def load_weights(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict in folder: model.safetensors, else a torch state dict (*.pt, *.pth)."""
    folder = Path(folder)
    safetensors_file = folder / "model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors_file))
        except Exception as error:  # noqa: BLE001 - a truncated or foreign file: say which, in one line
            fail(f"cannot read {safetensors_file}: {error}")
    candidates = sorted(p for p in folder.iterdir() if p.suffix in (".pt", ".pth") and p.is_file()) if folder.is_dir() else []
    preferred = [p for p in candidates if p.stem == "model"] or candidates
    if not preferred:
        fail(f"no model.safetensors or *.pt / *.pth weights in {folder}")
    path = preferred[0]
    try:
        with _checkpoint_globals():
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever torch.load raised, one line naming the file
        fail(f"cannot read {path}: {error}")
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a checkpoint rather than a bare state dict
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        fail(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _checkpoint_globals() -> AbstractContextManager[object]:
    """What torch.load(weights_only=True) must allow to read an SDK checkpoint (the weights a
    job stopped early on its metric returns are one): numpy's random state, and nothing more."""
    try:
        import numpy
    except ImportError:
        return contextlib.nullcontext()
    # numpy's stubs do not list the multiarray submodule that numpy/_core/__init__.py imports.
    multiarray = numpy._core.multiarray if hasattr(numpy, "_core") else numpy.core.multiarray  # type: ignore[attr-defined]
    return torch.serialization.safe_globals([multiarray._reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))])


@overload
def read_recipe_json(folder: str | os.PathLike[str], required: Literal[True]) -> dict[str, Any]: ...
@overload
def read_recipe_json(folder: str | os.PathLike[str], required: bool = False) -> dict[str, Any] | None: ...
def read_recipe_json(folder: str | os.PathLike[str], required: bool = False) -> dict[str, Any] | None:
    path = Path(folder) / "recipe.json"
    if not path.is_file():
        if required:
            fail(f"{folder} has no recipe.json (the architecture and data description a recipe run writes)")
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        fail(f"{path} is not valid JSON: {error}")


def load_into(model: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Load state into model, or fail with one line naming what does not match."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
        if wrong:
            parts.append(f"shape {'; '.join(wrong[:3])}")
        fail(f"the weights in {where} do not match the architecture: {'; '.join(parts)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


def starting_model(recipe_name: str) -> tuple[Path | None, dict[str, Any] | None]:
    """(the model a training run fine-tunes ($E31_MODEL_DIR/start), its recipe.json), or
    (None, None) for a run from scratch. A model another recipe made ends the run."""
    start = start_dir()
    start_info = read_recipe_json(start) if start else None
    if start_info is not None and start_info.get("recipe") != recipe_name:
        fail(f"the starting model was made by recipe {start_info.get('recipe')!r}, not {recipe_name!r}")
    return start, start_info


def prepare_model(model: M, start: Path | None, config: Config, device: torch.device) -> M:
    """A freshly built model made ready to train: the starting model's weights loaded when it
    fine-tunes one (start), LoRA adapters added when the configuration asks for them, on device."""
    if start is not None:
        load_into(model, load_weights(start), f"{start}")
    if config["adaptation"] == "lora":
        apply_lora(model, config["lora_rank"], config["lora_alpha"])
    model.to(device)
    return model


def save_outputs(model: nn.Module, recipe_info: dict[str, Any], out_dir: str | os.PathLike[str], adapters: dict[str, torch.Tensor] | None = None) -> None:
    """Write model.safetensors (LoRA merged in), recipe.json and, for LoRA, adapters.safetensors."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = dict(recipe_info)
    if adapters is None and has_lora(model):
        adapters = lora_state_dict(model)
    plain = merge_lora(model) if has_lora(model) else model
    save_file(_contiguous(plain.state_dict()), str(out_dir / "model.safetensors"))
    if adapters:
        first = next(m for m in model.modules() if isinstance(m, LoRALinear))
        info["adaptation"] = {"kind": "lora", "rank": first.rank, "alpha": first.alpha}
        metadata = {"rank": str(first.rank), "alpha": repr(first.alpha)}
        save_file(_contiguous(adapters), str(out_dir / "adapters.safetensors"), metadata=metadata)
    else:
        info.setdefault("adaptation", {"kind": "full"})
    (out_dir / "recipe.json").write_text(json.dumps(info, indent=2))


def _contiguous(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def write_json(path: str | os.PathLike[str], value: object) -> None:
    Path(path).write_text(json.dumps(value, indent=2))


# -- training loop ----------------------------------------------------------------------------


def fit(
    model: nn.Module,
    config: Config,
    dist: Dist,
    *,
    train_loss: Callable[[nn.Module, int], torch.Tensor],
    evaluate: Callable[[], Metrics],
    finetuning: bool,
) -> tuple[dict[str, Any] | None, bool]:
    """Train model (already on dist.device, LoRA applied if asked) for config["max_steps"] steps.

    train_loss(module, step) returns the loss of the step's batch (a function of the step alone,
    so a resumed run sees the batches an uninterrupted one would). evaluate() returns metrics
    with "val_loss" in them, computed on fixed data. Checkpoints through the SDK every
    checkpoint_every steps, at each new best of a validation metric (of the metric the network
    watches, in its mode: see network_watch) and when the network asks the job to stop; stops
    early after `patience` evaluations without a better val_loss and then goes back to the best
    weights, keeping the last ones for last/. Stopped by the network early on the metric it
    watches, it goes back to the weights of that metric's best step (the checkpoint taken at it,
    or the latest before it: see network_best) the same way.
    Returns (final metrics, stopped): stopped is True when the run stopped on the network's
    request, before its end (the checkpoint is written; a restart resumes it).
    """
    wrapped = dist.wrap(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config["lr"], weight_decay=0.0)
    # fp16 scales the loss so small gradients survive; off, the scaler passes everything through.
    # Under FSDP2 the gradients are DTensors, whose inf check is reduced across the processes.
    scaler = torch.amp.GradScaler(dist.device.type, enabled=precision_plan(dist.device).scaler)
    patience, max_steps = config["patience"], config["max_steps"]
    watch = network_watch(os.environ)

    # e31.checkpoint and e31.resume see the whole (unsharded) state, so an FSDP run's checkpoint
    # does not depend on how many processes wrote it, and a restart with another number resumes it.
    state = e31.resume(
        model=_Loads(lambda saved: dist.load_model_state(model, saved)),
        optimizer=_Loads(lambda saved: dist.load_optimizer_state(model, optimizer, saved)),
        map_location=dist.device,
    )
    extra = state.extra if state else {}
    step = state.step if state else 0
    best = extra.get("best", math.inf)
    best_step = extra.get("best_step")
    bad = extra.get("bad", 0)
    best_state = extra.get("best_state")
    last = extra.get("last_metrics")
    bests = extra.get("bests", {})  # {name: (step, value)}: each validation metric's best, checkpointed there
    watched = extra.get("watched")  # (step, value): the best of the metric the network watches, in its mode
    if extra.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(extra["scaler"])
    improved = False
    if state is not None:
        assert state.path is not None  # resume() names the file it read
        print(f"resumed from {state.path.name} at step {step}", flush=True)
    elif finetuning:
        # The starting point, measured before any step: equal to the previous run's final evaluation.
        last = evaluate()
        e31.log_metric(0, **last)
        watched = _watched(watch, watched, 0, last)
        best, best_step, best_state = last["val_loss"], 0, _snapshot(model, dist) if patience else None
        improved = _improved(bests, 0, last, watch)  # checkpointed below: a fine-tuning that only gets worse returns its start
    if improved:
        _checkpoint(
            0,
            model,
            optimizer,
            dist,
            best=best,
            best_step=best_step,
            bad=bad,
            best_state=best_state,
            last_metrics=last,
            bests=bests,
            scaler=scaler.state_dict(),
            watched=watched,
        )

    stopping = early = False
    network = None  # (metric, mode, best point) when the network stopped the run early on its metric
    while step < max_steps and not early:
        step += 1
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with autocast(dist.device):
            loss = train_loss(wrapped, step)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        scaler.step(optimizer)  # skipped (and the scale lowered) when fp16 gradients overflowed
        scaler.update()
        values = {"loss": loss.item()}
        improved = False
        if step % config["eval_every"] == 0 or step == max_steps:
            last = evaluate()
            values.update(last)
            if last["val_loss"] < best:
                best, best_step, bad = last["val_loss"], step, 0
                best_state = _snapshot(model, dist) if patience else None
            else:
                bad += 1
            early = bool(patience) and bad >= patience
            improved = dist.any(_improved(bests, step, last, watch))  # every process takes part in the checkpoint, or none
        e31.log_metric(step, **values)
        watched = _watched(watch, watched, step, values)
        stopping = dist.any(e31.should_stop())
        every = config["checkpoint_every"] or None
        if stopping or improved or (every and e31.checkpoint_due(step, every_steps=every)):
            _checkpoint(
                step,
                model,
                optimizer,
                dist,
                best=best,
                best_step=best_step,
                bad=bad,
                best_state=best_state,
                last_metrics=last,
                bests=bests,
                scaler=scaler.state_dict(),
                watched=watched,
            )
        if stopping:
            network = _stopped_on_metric(dist, watch, watched)
            if network is not None:
                break  # the run's end: the weights of the metric's best step go back (below)
            if step < max_steps and not early:
                print(f"stopping at step {step} of {max_steps}: {e31.stop_reason()}; checkpoint saved", flush=True)
                return last, True
            break
    if network is not None:
        return network_best(model, dist, evaluate, network, step)
    if early:
        print(f"early stop at step {step}: no better val_loss in {patience} evaluations", flush=True)
    if last is None:
        last = evaluate()
        e31.log_metric(step, **last)
    if patience and best_state is not None and best < last["val_loss"]:
        last_state, last_loss = _snapshot(model, dist), last["val_loss"]
        dist.load_model_state(model, best_state)
        # The best weights' evaluation is already logged, at their step: not logged again here
        # under this step, which would chart them as the last weights'.
        returned = _Final(evaluate())
        returned["early_stop"] = {
            "metric": "val_loss",
            "mode": "min",
            "best": best,
            "best_step": best_step,
            "weights_step": best_step,
            "last": LAST,
            "last_step": step,
        }
        returned.last_state = last_state
        if dist.writer:
            at = f"step {best_step}" if best_step is not None else "an earlier step"
            print(
                f"the weights returned are those of {at}, where val_loss was best ({best:.6g}); the last ones "
                f"(step {step}, val_loss {last_loss:.6g}) are kept under {LAST}",
                flush=True,
            )
        return returned, False
    return last, False


LAST = returned.LAST  # where the last weights go when early stopping returns better ones


class _Final(dict[str, Any]):
    """The final evaluation (written as metrics.json) and, when early stopping went back to
    better weights, the last ones' state in last_state (written under last/)."""

    last_state: dict[str, Any] | None = None


def network_watch(environ: Mapping[str, str]) -> MetricWatch | None:
    """(metric, mode) the network watches to stop the run early ($E31_EARLY_STOP_METRIC and
    $E31_EARLY_STOP_MODE in environ), or None."""
    metric = (environ.get("E31_EARLY_STOP_METRIC") or "").strip()
    mode = (environ.get("E31_EARLY_STOP_MODE") or "min").strip()
    return (metric, mode if mode in returned.MODES else "min") if metric else None


def _watched(watch: MetricWatch | None, watched: Point | None, step: int, values: Mapping[str, object]) -> Point | None:
    """The best point of the watched metric after a step's values (watch: network_watch())."""
    if watch is None or watch[0] not in values:
        return watched
    return returned.track(watched, step, values[watch[0]], watch[1])


def _stopped_on_metric(dist: Dist, watch: MetricWatch | None, watched: Point | None) -> tuple[str, str, Point | None] | None:
    """The run is told to stop: (metric, mode, its best point) when the network stopped it early
    on the metric it watches, else None (a cancel, its ceiling, a preemption). The best point is
    the network's (the notice's, counting the runs before a restart) or this run's own, if a
    better one came after the notice was written. In every process (a run of several agrees:
    each returns a value, or none does); only the first's best point is used."""
    found = returned.early_stop_of(e31.stop_notice())
    if not dist.any(found is not None):
        return None
    if found is None:
        return ("", "min", None)  # another process's notice: this one only takes part
    metric, mode, best = found
    if watch == (metric, mode):
        best = returned.better_of(best, watched, mode)
    return metric, mode, best


def network_best(
    model: nn.Module, dist: Dist, evaluate: Callable[[], Metrics], network: tuple[str, str, Point | None], step: int
) -> tuple[dict[str, Any], bool]:
    """The network stopped the run early on its metric at `step`: go back to the weights of the
    metric's best step, from the checkpoint taken at it (the run checkpoints at each new best) or
    the latest one before it, and keep the last weights for last/; the log and metrics.json say
    which, in the words the network uses for a script (e31.best). Without such a checkpoint the
    last weights are the output, and the log says why. Returns (final metrics, False)."""
    metric, mode, best = network
    path = weights_step = None
    if dist.writer and best is not None:
        found = {int(m.group(1)): p for p in e31._checkpoint_dir().glob("step-*.pt") if (m := e31.STEP_FILE.match(p.name))}
        weights_step = returned.at_or_before(found, best[0])
        path = found.get(weights_step) if weights_step is not None else None
    if not dist.any(path is not None):
        if dist.writer:
            why = returned.unmatched_message(metric, best) if best is not None else f"no point of {metric} is known: the last weights are returned"
            print(why, flush=True)
        return evaluate(), False  # the run's end all the same: its last weights, evaluated, as its output
    last_state = _snapshot(model, dist) if dist.sharded or dist.writer else None
    state = _checkpoint_model(path) if path is not None else {}
    if dist.sharded or dist.writer:  # under DDP each process has its own copy: only the first's is written
        dist.load_model_state(model, state)
    final = _Final(evaluate())
    if dist.writer:
        # Only the first process looks for the checkpoint: it has found it, or all returned above.
        assert best is not None and weights_step is not None and path is not None
        final["early_stop"] = returned.best_report(metric, mode, best, path.name, weights_step, {}, last_step=step)["early_stop"]
        final.last_state = last_state
        print(returned.returned_message(metric, best, path.name, weights_step, last_step=step), flush=True)
    return final, False


def _checkpoint_model(path: Path) -> dict[str, Any]:
    """The model's state dict in an SDK checkpoint file (the whole, unsharded state)."""
    try:
        with _checkpoint_globals():
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever torch.load raised, one line naming the file
        fail(f"cannot read the checkpoint {path.name}: {error}")
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), dict):
        fail(f"the checkpoint {path.name} holds no model state")
    return payload["model"]


def _improved(bests: dict[str, tuple[int, float]], step: int, metrics: Mapping[str, object], watch: MetricWatch | None = None) -> bool:
    """Note each metric of an evaluation that is at its best so far (lower is better, higher for
    an accuracy; for the metric the network watches, as its mode says: watch is (metric, mode))
    in bests; True if any is."""
    better = False
    for name, value in metrics.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        previous = bests.get(name)
        higher = watch[1] == "max" if watch is not None and name == watch[0] else "accuracy" in name
        if previous is None or (value > previous[1] if higher else value < previous[1]):
            bests[name] = (step, float(value))
            better = True
    return better


def _checkpoint(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, dist: Dist, *, bests: dict[str, tuple[int, float]], **extra: Any) -> None:
    """Checkpoint through the SDK, keeping in the folder the newest two and those of each
    metric's best step (the SDK alone keeps the newest two): the network uploads a file once it
    has held still a moment, and a best one must reach it even when checkpoints come faster."""
    # Gathered here, in every process (a collective under FSDP); only rank 0 writes the file.
    held, held_optimizer = _Holds(dist.model_state(model)), _Holds(dist.optimizer_state(model, optimizer))
    written = e31.checkpoint(step, model=held, optimizer=held_optimizer, keep_local=None, bests=bests, **extra)
    if written is None:
        return
    found = sorted((int(m.group(1)), p) for p in written.parent.iterdir() if (m := e31.STEP_FILE.match(p.name)))
    spared: set[int | None] = {best_step for best_step, _ in bests.values()}
    watched = extra.get("watched")
    if watched is not None:  # the one holding the watched metric's best (or the latest before it): network_best reads it
        spared.add(returned.at_or_before([older for older, _ in found], watched[0]))
    for older, path in found[:-2]:
        if older not in spared:
            path.unlink(missing_ok=True)


def _snapshot(model: nn.Module, dist: Dist) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in dist.model_state(model).items()}


class _Holds:
    """A state gathered beforehand, in the shape e31.checkpoint() saves (it calls state_dict())."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state


class _Loads:
    """A loader in the shape e31.resume() restores into (it calls load_state_dict())."""

    def __init__(self, load: Callable[[Any], object]) -> None:
        self.load_state_dict = load


# -- evaluation of staged models --------------------------------------------------------------


def staged_models(recipe_name: str) -> list[tuple[str, dict[str, Any], dict[str, torch.Tensor]]]:
    """[(label, recipe.json, state dict)] for each subfolder of $E31_MODEL_DIR, in name order."""
    folder = model_dir()
    if folder is None or not folder.is_dir():
        fail("evaluate mode needs $E31_MODEL_DIR with one subfolder per model")
    found = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        info = read_recipe_json(sub, required=True)
        if info.get("recipe") != recipe_name:
            fail(f"model {sub.name!r} was made by recipe {info.get('recipe')!r}, not {recipe_name!r}")
        found.append((sub.name, info, load_weights(sub)))
    if not found:
        fail(f"no models in {folder}: expected one subfolder per model")
    return found


def staged_model(build: Callable[[dict[str, Any]], M], label: str, info: dict[str, Any], state: Mapping[str, torch.Tensor]) -> M:
    """One of staged_models() as a model: built by the recipe's build (from its recipe.json) and
    its weights loaded, or the run ends naming what is wrong."""
    try:
        model = build(info)
    except (KeyError, TypeError) as error:
        fail(f"model {label!r}: recipe.json lacks a usable architecture ({error})")
    load_into(model, state, f"model {label!r}")
    return model


def write_evaluation(recipe_name: str, metric: str, higher_is_better: bool, models: Mapping[str, tuple[Metrics, Sequence[float]]]) -> dict[str, Any]:
    """models: {label: (metrics, per_example)}; logs each model's metrics and writes evaluation.json."""
    report: dict[str, Any] = {"recipe": recipe_name, "metric": metric, "higher_is_better": higher_is_better, "models": {}}
    for label, (metrics, per_example) in models.items():
        report["models"][label] = {"metrics": metrics, "per_example": [float(v) for v in per_example]}
        e31.log_metric(None, **{f"{label}/{k}" if _metric_name_ok(label) else k: v for k, v in metrics.items()})
        print(f"{label}: " + " ".join(f"{k}={v:.6g}" for k, v in metrics.items()), flush=True)
    if int(os.environ.get("RANK", "0") or 0) == 0:
        write_json(output_dir() / "evaluation.json", report)
    return report


def _metric_name_ok(label: str) -> bool:
    return all(c.isalnum() or c in "_.-" for c in label) and len(label) <= 60


# -- a recipe's run ---------------------------------------------------------------------------


def write_results(model: nn.Module, info: dict[str, Any], config: Config, final: dict[str, Any] | None, stopped: bool) -> None:
    """Rank 0's end of a training run: the weights always (so far, when stopped), and the final
    evaluation in metrics.json when the run reached its end (with, when early stopping went
    back to better weights, the step they are of and the last weights under last/)."""
    out = output_dir()
    save_outputs(model, {**info, "config": config}, out)
    if stopped:
        return
    last_state = getattr(final, "last_state", None)
    if last_state is not None:  # early stopping went back to better weights: the last ones beside them
        last = copy.deepcopy(model)
        last.load_state_dict(last_state)
        save_outputs(last, {**info, "config": config}, out / LAST)
    write_json(out / "metrics.json", final)
    print(f"done: {final}", flush=True)


def main(recipe_name: str, train: Callable[[Config, Dist], None], evaluate_staged: Callable[[Config], None]) -> None:
    """A recipe's entry point: check the configuration, then evaluate the staged models or train
    (in the process group torchrun set up, when it did)."""
    e31.should_stop()  # installs the SIGTERM handler now, so a stop while data loads is answered
    config = load_config(recipe_name)
    # Checked (a bad $E31_PRECISION ends the run here, before data loads) and, when what runs is
    # not what was asked, said once.
    note = precision_plan(pick_device()).note
    if note and int(os.environ.get("RANK", "0") or 0) == 0:
        print(note, flush=True)
    torch.manual_seed(config["seed"])
    if config["mode"] == "evaluate":
        evaluate_staged(config)
        return
    dist = Dist(config.get("parallel", "ddp"))
    try:
        train(config, dist)
    except BaseException:
        dist.close()
        raise
    dist.close(finished=True)
    if dist.active:
        leave()


def leave() -> NoReturn:
    """End a finished run of several processes here, its outputs written and its process group
    left: the interpreter's own teardown destroys what torch.distributed still holds (gloo's
    threads, tensors kept by their work) in no fixed order, and now and then aborted a process
    ("terminate called without an active exception", exit -6) after the run had finished, which
    turned a finished run into a failed one. What a run writes (metrics, outputs, checkpoints) is
    closed as it is written; only the standard streams are left to flush."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
