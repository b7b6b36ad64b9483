"""Train a small network on scikit-learn's handwritten digits (8x8 images, 10 classes).

On E31 Network it reads CSV files from $E31_DATA_DIR/train (and $E31_DATA_DIR/heldout if
given), its settings from the JSON file at $E31_CONFIG, and writes its weights to
$E31_OUTPUT_DIR/model.pt. Run directly (python train.py) it loads the data from scikit-learn
and writes to ./output. It trains in a few seconds on a CPU.

CSV columns: p0..p63 (pixel intensities 0-16), then label (0-9), with a header row.
"""

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

DEFAULTS = {"epochs": 30, "lr": 0.003, "hidden": 128, "batch_size": 64, "seed": 0}


def build_model(hidden=128):
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def load_csv_dir(folder):
    files = sorted(Path(folder).glob("*.csv"))
    if not files:
        return None
    table = np.concatenate([np.loadtxt(f, delimiter=",", skiprows=1, dtype=np.float32) for f in files])
    return table[:, :64] / 16.0, table[:, 64].astype(np.int64)


def split_digits(seed=0, heldout_fraction=0.2):
    """scikit-learn's digits, shuffled once and split; the same split as the demo dataset."""
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
        return (model(torch.from_numpy(x)).argmax(dim=1).numpy() == y).mean().item()


def main():
    config = dict(DEFAULTS)
    if os.environ.get("E31_CONFIG"):
        config.update(json.loads(Path(os.environ["E31_CONFIG"]).read_text() or "{}"))
    out_dir = Path(os.environ.get("E31_OUTPUT_DIR", "output"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config["seed"])

    (x, y), heldout = load_data()
    print(f"training on {len(y)} images, holding out {0 if heldout is None else len(heldout[1])}; config {config}")
    model = build_model(config["hidden"])
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.CrossEntropyLoss()
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    started = time.time()
    for epoch in range(1, config["epochs"] + 1):
        order = torch.randperm(len(ys))
        total = 0.0
        for i in range(0, len(ys), config["batch_size"]):
            batch = order[i : i + config["batch_size"]]
            optimizer.zero_grad()
            loss = loss_fn(model(xs[batch]), ys[batch])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        line = f"epoch {epoch}/{config['epochs']} loss {total / len(ys):.4f}"
        if heldout is not None:
            line += f" heldout_accuracy {accuracy(model, *heldout):.4f}"
        print(line, flush=True)

    metrics = {"train_accuracy": accuracy(model, x, y), "seconds": round(time.time() - started, 2)}
    if heldout is not None:
        metrics["heldout_accuracy"] = accuracy(model, *heldout)
    torch.save(model.state_dict(), out_dir / "model.pt")
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"done: {metrics}; weights written to model.pt")


if __name__ == "__main__":
    main()
