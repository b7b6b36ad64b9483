"""Train a small MLP on the handwritten digits, written as a SageMaker PyTorch script with two
channels: it reads its training set from SM_CHANNEL_TRAINING and scores the model on
SM_CHANNEL_TESTING; its hyperparameters come as command-line arguments (argparse defaults
otherwise); it saves the model to SM_MODEL_DIR and keeps a copy of its own source beside it.

Nothing here is specific to E31 Network. CSV files in each channel: columns p0..p63 (pixel
intensities 0-16), then label, with a header row.
"""

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def load(channel):
    files = sorted(Path(channel).glob("*.csv"))
    if not files:
        raise ValueError(f"no CSV files in {channel}")
    table = np.concatenate([np.loadtxt(f, delimiter=",", skiprows=1, dtype=np.float32, ndmin=2) for f in files])
    return torch.from_numpy(table[:, :64] / 16.0), torch.from_numpy(table[:, 64].astype(np.int64))


def accuracy(model, features, labels):
    with torch.no_grad():
        return model(features).argmax(dim=1).eq(labels).float().mean().item()


def main(args):
    torch.manual_seed(args.seed)
    x_train, y_train = load(args.train)
    x_test, y_test = load(args.test)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for epoch in range(1, args.epochs + 1):
        for start in range(0, len(x_train), args.batch_size):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[start : start + args.batch_size]), y_train[start : start + args.batch_size])
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: test accuracy {accuracy(model, x_test, y_test):.4f}", flush=True)
    os.makedirs(args.model_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.model_dir, "model.pth"))
    # The source that made these weights, kept with them (it is in the working folder).
    shutil.copy("train.py", os.path.join(args.model_dir, "train.py"))
    metrics = {"test_accuracy": accuracy(model, x_test, y_test), "epochs": args.epochs, "lr": args.lr}
    with open(os.path.join(args.model_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f)
    print(f"metrics: {json.dumps(metrics)}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    parser.add_argument("--train", default=os.environ.get("SM_CHANNEL_TRAINING"))
    parser.add_argument("--test", default=os.environ.get("SM_CHANNEL_TESTING"))
    main(parser.parse_args())
