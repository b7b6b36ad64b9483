"""The classifier recipe: an MLP on tabular data (or flattened images).  python -m e31.recipes.classifier

Data: $E31_DATA_DIR/train/ and $E31_DATA_DIR/heldout/ hold CSV files (a header row; the column
named "label", else the last column, is the label; every other column is a numeric feature) and/or
NPZ files (arrays x of shape (N, ...) and y of shape (N,)). Without heldout/, a fixed 10% of the
training rows is held out. Features are standardised with the training set's mean and standard
deviation, kept in recipe.json so that evaluation and fine-tuning standardise the same way.
"""

import csv
import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from e31.recipes import common

Label = int | str  # a class label: a whole number, else text (see _label_value)
Split = tuple[npt.NDArray[np.float32], list[Label]]  # (features (N, F), labels)

NAME = "classifier"
EVAL_BATCH = 4096
HOLDOUT_FRACTION = 0.1


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        sizes = [in_features] + [hidden] * layers
        parts: list[nn.Module] = []
        for width_in, width_out in itertools.pairwise(sizes):
            parts += [nn.Linear(width_in, width_out), nn.ReLU()]
        parts.append(nn.Linear(sizes[-1], classes))
        self.net = nn.Sequential(*parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(info: dict[str, Any]) -> MLP:
    arch = info["architecture"]
    return MLP(arch["in_features"], arch["hidden"], arch["layers"], arch["classes"])


# -- data -------------------------------------------------------------------------------------


def _label_value(value: object) -> Label:
    """Labels as ints when they are whole numbers ("3", 3.0, np.int64(3)), else as strings."""
    text = str(value.item() if hasattr(value, "item") else value).strip()
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if math.isfinite(number) and number == int(number) else text


def read_csv(path: Path) -> Split:
    with open(path, newline="") as handle:
        rows = [row for row in csv.reader(handle) if row]
    if len(rows) < 2:
        common.fail(f"{path} has no data rows (a header row, then one row per example)")
    names = [name.strip() for name in rows[0]]
    column = names.index("label") if "label" in names else len(names) - 1
    features: list[list[float]] = []
    labels: list[Label] = []
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(names):
            common.fail(f"{path} line {number}: {len(row)} values, the header has {len(names)}")
        try:
            features.append([float(v) for i, v in enumerate(row) if i != column])
        except ValueError:
            common.fail(f"{path} line {number}: a feature is not a number (only the label column may be text)")
        labels.append(_label_value(row[column]))
    return np.asarray(features, dtype=np.float32).reshape(len(labels), -1), labels


def read_npz(path: Path) -> Split:
    with np.load(path, allow_pickle=False) as arrays:
        if "x" not in arrays or "y" not in arrays:
            common.fail(f"{path} needs arrays named x and y, has {', '.join(arrays.files)}")
        x, y = arrays["x"], arrays["y"]
    if len(x) != len(y):
        common.fail(f"{path}: x has {len(x)} rows, y has {len(y)}")
    return x.reshape(len(x), -1).astype(np.float32), [_label_value(v) for v in y.reshape(-1)]


def load_split(folder: str | os.PathLike[str]) -> Split | None:
    """(features (N, F) float32, labels list) from the CSV and NPZ files in folder; None if none."""
    folder = Path(folder)
    files = sorted(p for p in folder.glob("*") if p.suffix in (".csv", ".npz") and p.is_file()) if folder.is_dir() else []
    if not files:
        return None
    parts = [read_csv(p) if p.suffix == ".csv" else read_npz(p) for p in files]
    widths = {x.shape[1] for x, _ in parts}
    if len(widths) > 1:
        common.fail(f"the files in {folder} have different feature counts: {sorted(widths)}")
    return np.concatenate([x for x, _ in parts]), [label for _, labels in parts for label in labels]


def load_data() -> tuple[Split, Split]:
    """(train, validation), each (features, labels)."""
    root = common.data_dir()
    train = load_split(root / "train")
    if train is None:
        common.fail(f"no CSV or NPZ files in {root / 'train'}")
    heldout = load_split(root / "heldout")
    if heldout is not None:
        return train, heldout
    x, labels = train
    if len(labels) < 2:
        common.fail("need at least 2 training rows to hold out a validation set (or give heldout/)")
    order = np.random.default_rng(0).permutation(len(labels))  # fixed: the same split for every run
    cut = max(1, int(len(labels) * HOLDOUT_FRACTION))
    val, keep = np.sort(order[:cut]), np.sort(order[cut:])
    return (x[keep], [labels[i] for i in keep]), (x[val], [labels[i] for i in val])


def _sort_key(label: Label) -> tuple[bool, Label]:
    return (isinstance(label, str), label)


def encode(labels: Sequence[Label], classes: Sequence[Label], where: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted({label for label in labels if label not in index}, key=_sort_key)
    if unknown:
        common.fail(f"{where} has labels the model has no class for: {unknown[:5]} (classes: {classes[:10]})")
    return torch.tensor([index[label] for label in labels], dtype=torch.long)


def standardise(x: npt.NDArray[np.float32], info: dict[str, Any]) -> torch.Tensor:
    mean = np.asarray(info["data"]["mean"], dtype=np.float32)
    std = np.asarray(info["data"]["std"], dtype=np.float32)
    return torch.from_numpy((x - mean) / std)


def describe(config: common.Config, train: Split, validation: Split, start_info: dict[str, Any] | None) -> dict[str, Any]:
    """recipe.json's content: the architecture and the data description (classes, normalisation)."""
    if start_info is not None:
        info = {"recipe": NAME, "format": common.FORMAT, "architecture": start_info["architecture"], "data": start_info["data"]}
        if info["data"]["features"] != train[0].shape[1]:
            common.fail(f"the starting model takes {info['data']['features']} features; the data has {train[0].shape[1]}")
        return info
    x = train[0].astype(np.float64)
    mean = x.mean(axis=0).astype(np.float32)
    std = x.std(axis=0).astype(np.float32)
    std[~(std > 1e-12)] = 1.0  # constant columns: leave them at zero
    classes = sorted(set(train[1]) | set(validation[1]), key=_sort_key)
    return {
        "recipe": NAME,
        "format": common.FORMAT,
        "architecture": {"in_features": x.shape[1], "hidden": config["hidden"], "layers": config["layers"], "classes": len(classes)},
        "data": {"features": x.shape[1], "classes": classes, "mean": mean.tolist(), "std": std.tolist()},
    }


# -- evaluation -------------------------------------------------------------------------------


@torch.no_grad()
def score(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[common.Metrics, list[float]]:
    """(metrics, per-example correctness) on the whole of (x, y), in fixed chunks."""
    model.eval()
    losses: list[torch.Tensor] = []
    correct: list[torch.Tensor] = []
    for start in range(0, len(y), EVAL_BATCH):
        with common.autocast(device):
            logits = model(x[start : start + EVAL_BATCH]).float()
        target = y[start : start + EVAL_BATCH]
        losses.append(nn.functional.cross_entropy(logits, target, reduction="none").double())
        correct.append((logits.argmax(dim=1) == target).double())
    all_losses, all_correct = torch.cat(losses), torch.cat(correct)
    return {"loss": all_losses.mean().item(), "accuracy": all_correct.mean().item()}, all_correct.cpu().tolist()


def evaluate_staged(config: common.Config) -> None:
    device = common.pick_device()
    heldout = load_split(common.data_dir() / "heldout")
    if heldout is None:
        common.fail(f"evaluate mode needs CSV or NPZ files in {common.data_dir() / 'heldout'}")
    results: dict[str, tuple[common.Metrics, list[float]]] = {}
    for label, info, state in common.staged_models(NAME):
        if info.get("data", {}).get("features") != heldout[0].shape[1]:
            common.fail(f"model {label!r} takes {info.get('data', {}).get('features')} features; the heldout data has {heldout[0].shape[1]}")
        model = common.staged_model(build_model, label, info, state)
        x = standardise(heldout[0], info).to(device)
        y = encode(heldout[1], info["data"]["classes"], f"the heldout data (model {label!r})").to(device)
        results[label] = score(model.to(device), x, y, device)
    common.write_evaluation(NAME, "accuracy", True, results)


# -- training ---------------------------------------------------------------------------------


def train(config: common.Config, dist: common.Dist) -> None:
    start, start_info = common.starting_model(NAME)
    train_set, validation = load_data()
    info = describe(config, train_set, validation, start_info)
    classes = info["data"]["classes"]
    x = standardise(train_set[0], info)
    y = encode(train_set[1], classes, "the training data")
    if config["smoke"]:
        keep = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[: common.smoke_count(len(y), config["batch_size"])]
        x, y = x[keep], y[keep]
    device = dist.device
    x, y = x.to(device), y.to(device)
    val_x = standardise(validation[0], info).to(device)
    val_y = encode(validation[1], classes, "the validation data").to(device)

    model = common.prepare_model(build_model(info), start, config, device)
    if dist.writer:
        print(
            f"classifier: {len(y)} training rows, {len(val_y)} validation rows, {info['data']['features']} features, "
            f"{len(classes)} classes; {'fine-tuning the model in $E31_MODEL_DIR/start' if start else 'from scratch'}; {dist.describe()}; config {config}",
            flush=True,
        )

    batch_size, seed = config["batch_size"], config["seed"]
    per_epoch = math.ceil(len(y) / batch_size)
    orders: dict[int, torch.Tensor] = {}

    def train_loss(module: nn.Module, step: int) -> torch.Tensor:
        epoch, position = divmod(step - 1, per_epoch)
        if epoch not in orders:  # each epoch's order is a function of (seed, epoch): nothing to save
            orders.clear()
            orders[epoch] = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).to(device)
        batch = dist.shard(orders[epoch][position * batch_size : (position + 1) * batch_size])
        return nn.functional.cross_entropy(module(x[batch]), y[batch])

    def evaluate() -> common.Metrics:
        metrics, _ = score(model, val_x, val_y, device)
        return {"val_loss": metrics["loss"], "val_accuracy": metrics["accuracy"]}

    final, stopped = common.fit(model, config, dist, train_loss=train_loss, evaluate=evaluate, finetuning=start is not None)
    if not dist.writer:
        return
    common.write_results(model, info, config, final, stopped)


def main() -> None:
    common.main(NAME, train, evaluate_staged)


if __name__ == "__main__":
    main()
