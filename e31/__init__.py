"""e31: what a training script may use inside an E31 Network job.

Checkpoints that survive preemption, metrics the network can chart and act on, and the
network's request to stop. It needs nothing but the standard library to import; torch (and
numpy, when installed) are imported only by the functions that need them.

The environment a job sees
--------------------------
E31_JOB_ID          the job's id.
E31_DATA_DIR        the staged dataset: train/ and heldout/ inside.
E31_OUTPUT_DIR      write what the job produces here (weights, reports); kept after the job.
E31_CHECKPOINT_DIR  checkpoint() writes here and resume() reads here; a file that appears
                    under a name that starts with neither "." nor ends in ".tmp" is picked up
                    by the network, and put back in this folder when the job is restarted.
E31_CONFIG          path of a JSON file: the job's configuration (hyperparameters).
E31_METRICS_FILE    log_metric() appends one JSON line per call to this file.
E31_STOP_FILE       created (with JSON {"reason": ..., "deadline": <unix time>}) when the
                    network asks the job to stop; see should_stop() and stop_notice().
E31_EARLY_STOP_METRIC, E31_EARLY_STOP_MODE
                    the metric the network watches to stop the job early, and "min" or
                    "max"; unset when it watches none (see e31/best.py).
E31_RESTART         how many times the job was restarted: "0" on the first run.
E31_NUM_DEVICES     how many devices (GPUs, or CPU slots) the job holds.

The names SageMaker scripts expect are set too:
SM_MODEL_DIR (= E31_OUTPUT_DIR), SM_OUTPUT_DATA_DIR, SM_CHANNEL_TRAIN (= $E31_DATA_DIR/train),
SM_CHANNEL_HELDOUT (= $E31_DATA_DIR/heldout), SM_NUM_GPUS, SM_HPS (the configuration as JSON).

Usage
-----
    import e31

    state = e31.resume(model=model, optimizer=optimizer)   # None on a first run
    start = state.step + 1 if state else 1
    for step in range(start, total_steps + 1):
        loss = train_one_batch(model, optimizer)
        e31.log_metric(step, loss=loss)
        stopping = e31.should_stop()          # preempted, out of time, cancelled, ...
        if stopping or e31.checkpoint_due(step, every_steps=500, every_seconds=600):
            e31.checkpoint(step, model=model, optimizer=optimizer)
        if stopping:
            print("stopping:", e31.stop_reason())
            break
    torch.save(model.state_dict(), os.path.join(os.environ["E31_OUTPUT_DIR"], "model.pt"))

Outside a job (on a laptop) the same script works: checkpoints go to ./checkpoints and
metrics are printed. In a job of several processes (torchrun), only the process whose RANK
is 0 writes checkpoints and metrics; every process may call resume().
"""

import json
import math
import operator
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, SupportsFloat, SupportsIndex

if TYPE_CHECKING:
    import torch

__all__ = [
    "Resumed",
    "checkpoint",
    "checkpoint_due",
    "latest_checkpoint",
    "log_metric",
    "resume",
    "should_stop",
    "stop_notice",
    "stop_reason",
]

FORMAT = 1
STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
METRIC_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,100}$")


class Saves(Protocol):
    """What checkpoint() saves the state of: a model, an optimizer, a scheduler (torch's, or
    anything with a state_dict())."""

    def state_dict(self) -> Any: ...


class Loads(Protocol):
    """What resume() restores the state of: anything with a load_state_dict(state)."""

    def load_state_dict(self, state: Any, /) -> object: ...


class _State:
    """What this process remembers between calls (one instance; tests swap in a fresh one)."""

    def __init__(self) -> None:
        self.last_checkpoint_at: float | None = None  # _clock() at the last checkpoint() call
        self.sigterm = False
        self.handler_installed = False
        self.previous_handler: Callable[[int, FrameType | None], Any] | None = None
        self.file_seen = False  # $E31_STOP_FILE has appeared
        self.file_reason: str | None = None  # the reason read from it
        self.file_notice: dict[str, Any] | None = None  # all of it, as read


_state = _State()
_lock = threading.Lock()
_clock = time.monotonic


def _is_writer() -> bool:
    """True in the process that writes (rank 0, or the only process)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _checkpoint_dir() -> Path:
    return Path(os.environ.get("E31_CHECKPOINT_DIR") or "checkpoints")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:
        pass
    else:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any] | None) -> None:
    if not state:
        return
    import torch

    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            pass
        else:
            numpy.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") and torch.cuda.is_available():
        saved = [s.cpu() for s in state["cuda"]]
        count = min(len(saved), torch.cuda.device_count())
        for index in range(count):
            torch.cuda.set_rng_state(saved[index], index)


def _step_files(folder: Path) -> dict[int, Path]:
    """{step: path} for the step-*.pt files in folder."""
    found: dict[int, Path] = {}
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return found
    for entry in entries:
        match = STEP_FILE.match(entry.name)
        if match and entry.is_file():
            found[int(match.group(1))] = Path(entry.path)
    return found


def checkpoint(
    step: SupportsIndex | float,
    *,
    model: Saves | None = None,
    optimizer: Saves | None = None,
    scheduler: Saves | None = None,
    data_position: Any = None,
    keep_local: int | None = 2,
    **extra: Any,
) -> Path | None:
    """Save a checkpoint of the run at this step; returns its path (None outside rank 0).

    Written to $E31_CHECKPOINT_DIR (./checkpoints when unset) as step-{step:012d}.pt, a dict:
    {"step", "model", "optimizer", "scheduler" (state dicts or None), "data_position",
    "rng" (Python's, numpy's, torch's and CUDA's random states), "extra" (the other keyword
    arguments), "format": 1}. The file is written under a hidden temporary name, synced and
    renamed, so its final name only ever shows a complete file. Older step-*.pt files are then
    deleted so that at most keep_local remain (None keeps all); the network keeps its own copies.
    In other ranks (RANK set and not "0") it writes nothing, but still restarts checkpoint_due()'s clock.
    data_position and extra may hold anything torch.save can pickle (a generator's state, an epoch,
    a sampler's position).
    """
    import torch

    step = _check_step(step)
    with _lock:
        _state.last_checkpoint_at = _clock()
    if not _is_writer():
        return None
    folder = _checkpoint_dir()
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "step": step,
        "model": None if model is None else model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "data_position": data_position,
        "rng": _rng_state(),
        "extra": extra,
    }
    name = f"step-{step:012d}.pt"
    final = folder / name
    temporary = folder / f".{name}.tmp"
    try:
        with open(temporary, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
    except BaseException:
        try:
            temporary.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(folder)
    if keep_local is not None:
        _prune(folder, final, max(int(keep_local), 1))
    return final


def _check_step(step: SupportsIndex | float) -> int:
    if isinstance(step, bool):
        raise TypeError("step must be an integer, not a bool")
    if isinstance(step, float):  # Python's and numpy's floats: taken when whole
        if not step.is_integer():
            raise TypeError(f"step must be an integer, got {step!r}")
        step = int(step)
    try:
        step = operator.index(step)  # ints, numpy integers, integer tensors
    except TypeError:
        raise TypeError(f"step must be an integer, got {step!r}") from None
    if step < 0:
        raise ValueError(f"step must be 0 or more, got {step}")
    return step


def _prune(folder: Path, keep: Path, keep_local: int) -> None:
    others = sorted(((s, p) for s, p in _step_files(folder).items() if p.name != keep.name), reverse=True)
    for _, path in others[keep_local - 1 :]:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def latest_checkpoint() -> Path | None:
    """The checkpoint resume() would load: the step-*.pt file of the highest step in
    $E31_CHECKPOINT_DIR or, when there is none, the most recently modified other *.pt file
    there (names that start with "." are skipped). None when there is none."""
    folder = _checkpoint_dir()
    steps = _step_files(folder)
    if steps:
        return steps[max(steps)]
    candidates: list[tuple[float, str, Path]] = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return None
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".pt") or not entry.is_file():
            continue
        candidates.append((entry.stat().st_mtime, entry.name, Path(entry.path)))
    return max(candidates)[2] if candidates else None


@dataclass(frozen=True)
class Resumed:
    """What resume() found: the step saved, the data position and extra values, the file."""

    step: int
    data_position: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def resume(
    *, model: Loads | None = None, optimizer: Loads | None = None, scheduler: Loads | None = None, map_location: "str | torch.device" = "cpu"
) -> Resumed | None:
    """Load the latest checkpoint (see latest_checkpoint()) into the objects given.

    Returns None when there is no checkpoint; else restores the model's, optimizer's and
    scheduler's state dicts (those given and saved), the Python, numpy, torch and CUDA random
    states, and returns Resumed(step, data_position, extra, path). The run continues at step + 1.

    The file is read with torch.load(weights_only=False): checkpoints hold numpy's random state
    and whatever the script put in data_position and extra, which the weights-only loader refuses.
    That unpickles arbitrary objects, so only load checkpoints this job (or you) wrote.
    A *.pt file that checkpoint() did not write may be a bare state dict (loaded into the model)
    or a dict with "model" (and "optimizer", "scheduler", "step") entries. Asking for an object
    whose state the file lacks raises ValueError rather than going on from scratch.
    """
    import torch

    path = latest_checkpoint()
    if path is None:
        return None
    saved = torch.load(path, map_location=map_location, weights_only=False)
    ours = isinstance(saved, dict) and saved.get("format") == FORMAT
    if not (ours or (isinstance(saved, dict) and isinstance(saved.get("model"), dict))):
        saved = {"model": saved}  # someone else's file: a bare state dict for the model
    for target, key in ((model, "model"), (optimizer, "optimizer"), (scheduler, "scheduler")):
        if target is None:
            continue
        if saved.get(key) is None:
            raise ValueError(f"{path} holds no {key} state to resume from")
        target.load_state_dict(saved[key])
    if ours:
        _restore_rng(saved.get("rng"))
    step = saved.get("step")
    if step is None:  # not ours: a step in the file's name (checkpoint-1000.pt), else 0
        match = re.search(r"(\d+)", path.stem)
        step = int(match.group(1)) if match else 0
    extra = saved.get("extra") if ours else None
    return Resumed(step=int(step), data_position=saved.get("data_position"), extra=extra or {}, path=path)


def _metric_value(name: str, value: SupportsFloat | str | bytes | None) -> float | str:
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"metric {name!r}: expected a number, got {value!r}")
    if not isinstance(value, (int, float)) and hasattr(value, "item"):
        value = value.item()  # a 0-d tensor, a numpy scalar or 0-d array
    try:
        number = float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"metric {name!r}: expected a number, got {value!r}") from error
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "Infinity" if number > 0 else "-Infinity"
    return number


def log_metric(step: SupportsIndex | float | None, **values: SupportsFloat) -> None:
    """Record metric values at a step: log_metric(120, loss=0.51, accuracy=0.9).

    Appends one line of JSON, {"step": 120, "at": <unix time>, "values": {...}}, to the file
    named by $E31_METRICS_FILE; the network charts it and may act on it (a NaN loss can stop the
    job). Values are numbers (ints, floats, 0-d tensors, numpy scalars), written as floats; NaN and
    infinities are written as the strings "NaN", "Infinity" and "-Infinity", so each line is strict
    JSON. Names are 1-100 letters, digits, "_", ".", "/" or "-". step may be None. Outside a job
    (no $E31_METRICS_FILE) the values are printed. Only rank 0 writes.
    """
    if step is not None:
        step = _check_step(step)
    if not values:
        raise ValueError("log_metric needs at least one value, e.g. log_metric(step, loss=0.5)")
    converted: dict[str, float | str] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not METRIC_NAME.match(name):
            raise ValueError(f"bad metric name {name!r}: use 1-100 letters, digits, '_', '.', '/' or '-'")
        converted[name] = _metric_value(name, value)
    if not _is_writer():
        return
    target = os.environ.get("E31_METRICS_FILE")
    if not target:
        shown = " ".join(f"{name}={_show(value)}" for name, value in converted.items())
        print(f"step {step}: {shown}" if step is not None else shown, flush=True)
        return
    line = json.dumps({"step": step, "at": time.time(), "values": converted}, allow_nan=False) + "\n"
    data = line.encode("utf-8")
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)  # one write of the whole line (O_APPEND: never interleaved)
        while written < len(data):  # only on a full disk or a signal; finish the line
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def _show(value: float | str) -> str:
    return value if isinstance(value, str) else format(value, ".6g")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _state.sigterm = True
    previous = _state.previous_handler
    if callable(previous):
        previous(signum, frame)


def _install_handler() -> None:
    if _state.handler_installed or threading.current_thread() is not threading.main_thread():
        return
    _state.handler_installed = True
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return  # someone chose to ignore SIGTERM; leave it so
        _state.previous_handler = previous if callable(previous) else None
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        pass  # not possible here (an embedded interpreter); the stop file still works


def _stop_requested() -> bool:
    """Check the SIGTERM flag and the stop file, without installing the handler."""
    if _state.file_reason is not None:
        return True
    stop_file = os.environ.get("E31_STOP_FILE")
    if stop_file and (_state.file_seen or os.path.exists(stop_file)):
        _state.file_seen = True
        try:
            content = json.loads(Path(stop_file).read_text())
        except (OSError, ValueError):
            content = None  # still being written, or gone: the stop holds all the same
        if isinstance(content, dict):
            _state.file_reason = str(content.get("reason") or "stop requested")
            _state.file_notice = content
        return True
    return _state.sigterm


def should_stop() -> bool:
    """True once the network asked the job to stop (preemption, the end of its time, a cancel,
    early stopping): the file $E31_STOP_FILE exists or the process got SIGTERM. Stays True.

    The first call (from the main thread) installs a SIGTERM handler that only records the
    request, so a script that polls should_stop() gets to save a checkpoint and exit instead of
    dying; the network kills the job if it has not exited by the deadline. A script that never
    calls should_stop() keeps Python's default: SIGTERM ends it at once. An existing Python
    SIGTERM handler is still called after the request is recorded.
    """
    _install_handler()
    return _stop_requested()


def stop_reason() -> str | None:
    """Why the job is asked to stop ("preempted", ..., or "SIGTERM received"); None if it isn't."""
    if not _stop_requested():
        return None
    if _state.file_reason is not None:
        return _state.file_reason
    return "stop requested" if _state.file_seen else "SIGTERM received"


def stop_notice() -> dict[str, Any] | None:
    """The network's stop notice, as it wrote it to $E31_STOP_FILE: {"reason": ..., "deadline":
    <unix time>} and, when it stopped the job early on the metric it watches, "early_stop":
    {"metric", "mode", "best", "best_step"} (e31.best reads it). None when the job is not asked
    to stop, or only by SIGTERM."""
    if not _stop_requested():
        return None
    return dict(_state.file_notice) if _state.file_notice is not None else None


def checkpoint_due(step: int, *, every_steps: int | None = None, every_seconds: float | None = None) -> bool:
    """True when it is time to call checkpoint(): step is a positive multiple of every_steps,
    every_seconds have passed since the last checkpoint() (or since the first call of
    checkpoint_due()), or the network asked the job to stop. Step 0 is never due by count.
    It does not install should_stop()'s SIGTERM handler."""
    now = _clock()
    with _lock:
        if _state.last_checkpoint_at is None:
            _state.last_checkpoint_at = now
        since = now - _state.last_checkpoint_at
    if every_steps is not None:
        if every_steps <= 0:
            raise ValueError("every_steps must be positive")
        if step > 0 and step % every_steps == 0:
            return True
    if every_seconds is not None and since >= every_seconds:
        return True
    return _stop_requested()
