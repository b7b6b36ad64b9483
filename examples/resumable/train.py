"""A resumable, deterministic training run: a small MLP on the handwritten digits, with e31.

Stop it at any point (SIGTERM, preemption, a crash, SIGKILL) and start it again with the same
checkpoint folder: it resumes from the latest checkpoint and ends with weights identical, bit for
bit, to those of a run that was never interrupted (on the CPU, same machine type).

On E31 Network it reads CSV files from $E31_DATA_DIR/train (and $E31_DATA_DIR/heldout), its
settings from the JSON file at $E31_CONFIG, checkpoints to $E31_CHECKPOINT_DIR, logs metrics
to $E31_METRICS_FILE and writes its weights to $E31_OUTPUT_DIR/model.pt. Run directly, it loads
the data from scikit-learn, checkpoints to ./checkpoints and writes to ./output.

CSV columns: p0..p63 (pixel intensities 0-16), then label (0-9), with a header row.
"""

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from e31 import checkpoint, checkpoint_due, log_metric, resume, should_stop, stop_reason

DEFAULTS = {
    "steps": 300,
    "batch_size": 64,
    "lr": 0.003,
    "hidden": 128,
    "seed": 0,
    "checkpoint_every": 50,  # steps
    "checkpoint_seconds": None,  # also checkpoint when this many seconds passed since the last
    "sleep": 0.0,  # seconds to wait after each step (to make a short run long enough to interrupt)
    "eval_every": 50,
    "nan_at_step": None,  # log a NaN loss at this step (to try the network's NaN stop)
}


def load_config():
    config = dict(DEFAULTS)
    if os.environ.get("E31_CONFIG"):
        config.update(json.loads(Path(os.environ["E31_CONFIG"]).read_text() or "{}"))
    return config


def build_model(hidden):
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def load_csv_dir(folder):
    files = sorted(Path(folder).glob("*.csv"))
    if not files:
        return None
    table = np.concatenate([np.loadtxt(f, delimiter=",", skiprows=1, dtype=np.float32, ndmin=2) for f in files])
    return table[:, :64] / 16.0, table[:, 64].astype(np.int64)


def split_digits(seed=0, heldout_fraction=0.2):
    """scikit-learn's digits, shuffled once and split (outside a job)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    cut = int(len(order) * (1 - heldout_fraction))
    x = digits.data.astype(np.float32) / 16.0
    y = digits.target.astype(np.int64)
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def load_data():
    data_dir = os.environ.get("E31_DATA_DIR")
    if data_dir is None:
        return split_digits()
    train = load_csv_dir(Path(data_dir) / "train")
    if train is None:
        raise SystemExit(f"no CSV files in {data_dir}/train")
    return train, load_csv_dir(Path(data_dir) / "heldout")


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main():
    # Asked once at the start, so a stop that comes while the data loads (SIGTERM) is a request
    # this script answers with a checkpoint, not the end of the process.
    should_stop()
    config = load_config()
    out_dir = Path(os.environ.get("E31_OUTPUT_DIR", "output"))
    out_dir.mkdir(parents=True, exist_ok=True)
    # One thread: float sums then add up in the same order on every machine and every run.
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])

    (x, y), heldout = load_data()
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    if heldout is not None:
        eval_name, eval_x, eval_y = "heldout_accuracy", torch.from_numpy(heldout[0]), torch.from_numpy(heldout[1])
    else:
        eval_name, eval_x, eval_y = "train_accuracy", xs, ys
    model = build_model(config["hidden"])
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.CrossEntropyLoss()
    batch_size = config["batch_size"]
    batches_per_epoch = (len(ys) + batch_size - 1) // batch_size

    # Where we are in the data: the epoch, the next batch in it, and the shuffling generator's
    # state from before it drew this epoch's order (so a resumed run draws the same order again).
    generator = torch.Generator().manual_seed(config["seed"])
    epoch, batch_index, order, epoch_start_state = 0, 0, None, None
    step = 0
    state = resume(model=model, optimizer=optimizer)
    if state is not None:
        step = state.step
        position = state.data_position
        epoch, batch_index = position["epoch"], position["batch"]
        generator.set_state(position["generator"])
        if batch_index > 0:  # mid-epoch: draw the epoch's order again, as the first run did
            epoch_start_state = generator.get_state()
            order = torch.randperm(len(ys), generator=generator)
        print(f"resumed from {state.path.name} at step {step}", flush=True)
    else:
        print(f"training on {len(ys)} images for {config['steps']} steps; config {config}", flush=True)

    def data_position():
        at_epoch_start = order is None
        return {
            "epoch": epoch,
            "batch": batch_index,
            "generator": generator.get_state() if at_epoch_start else epoch_start_state,
        }

    every_steps = config["checkpoint_every"] or None
    started = time.time()
    loss_value = None
    stopping = False
    while step < config["steps"]:
        step += 1
        if order is None:
            epoch_start_state = generator.get_state()
            order = torch.randperm(len(ys), generator=generator)
        batch = order[batch_index * batch_size : (batch_index + 1) * batch_size]
        optimizer.zero_grad()
        loss = loss_fn(model(xs[batch]), ys[batch])
        loss.backward()
        optimizer.step()
        batch_index += 1
        if batch_index == batches_per_epoch:
            epoch, batch_index, order = epoch + 1, 0, None

        loss_value = loss.item()
        if config["nan_at_step"] is not None and step == config["nan_at_step"]:
            log_metric(step, loss=float("nan"))
        else:
            log_metric(step, loss=loss_value)
        if config["eval_every"] and step % config["eval_every"] == 0:
            log_metric(step, **{eval_name: accuracy(model, eval_x, eval_y)})
        if config["sleep"]:
            time.sleep(config["sleep"])

        stopping = should_stop()
        if stopping or checkpoint_due(step, every_steps=every_steps, every_seconds=config["checkpoint_seconds"]):
            checkpoint(step, model=model, optimizer=optimizer, data_position=data_position())
        if stopping:
            break

    torch.save(model.state_dict(), out_dir / "model.pt")
    if stopping and step < config["steps"]:
        print(f"stopping at step {step} of {config['steps']}: {stop_reason()}; checkpoint saved, weights so far in model.pt", flush=True)
        return
    final_accuracy = accuracy(model, eval_x, eval_y)
    print(
        f"done: {step} steps, last loss {loss_value if loss_value is None else round(loss_value, 4)}, "
        f"{eval_name} {final_accuracy:.4f}, {time.time() - started:.1f}s this run; weights written to model.pt",
        flush=True,
    )


if __name__ == "__main__":
    main()
