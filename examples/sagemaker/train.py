"""Train a small MLP on the handwritten digits, written as a SageMaker PyTorch script.

Nothing here is specific to E31 Network: the script reads SageMaker's environment (SM_MODEL_DIR,
SM_CHANNEL_TRAIN, SM_OUTPUT_DATA_DIR, SM_HPS, SM_NUM_GPUS), which E31 Network sets as well.
CSV files in the train channel: columns p0..p63 (pixel intensities 0-16), then label, header row.
"""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)
logger.addHandler(logging.StreamHandler(sys.stdout))


class Net(nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _get_data_loader(batch_size, training_dir, shuffle=True):
    logger.info("Get data loader from %s", training_dir)
    files = sorted(Path(training_dir).glob("*.csv"))
    if not files:
        raise ValueError(f"no CSV files in {training_dir}")
    table = np.concatenate([np.loadtxt(f, delimiter=",", skiprows=1, dtype=np.float32, ndmin=2) for f in files])
    features = torch.from_numpy(table[:, :64] / 16.0)
    labels = torch.from_numpy(table[:, 64].astype(np.int64))
    return DataLoader(TensorDataset(features, labels), batch_size=batch_size, shuffle=shuffle)


def test(model, loader, device):
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    size = len(loader.dataset)
    return loss / size, correct / size


def train(args):
    use_cuda = args.num_gpus > 0 and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    torch.manual_seed(args.seed)

    train_loader = _get_data_loader(args.batch_size, args.train)
    eval_loader = _get_data_loader(args.batch_size, args.train, shuffle=False)
    logger.info("Training on %d images", len(train_loader.dataset))

    model = Net(args.hidden).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(1, args.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader, 1):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                logger.info("Train Epoch: %d [%d/%d]\tLoss: %.6f", epoch, batch_idx * len(data), len(train_loader.dataset), loss.item())
        train_loss, train_accuracy = test(model, eval_loader, device)
        logger.info("Epoch %d: train loss %.4f, train accuracy %.4f", epoch, train_loss, train_accuracy)

    save_model(model, args.model_dir)
    metrics = {"train_loss": train_loss, "train_accuracy": train_accuracy, "epochs": args.epochs}
    os.makedirs(args.output_data_dir, exist_ok=True)
    with open(os.path.join(args.output_data_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    logger.info("Metrics: %s", metrics)


def save_model(model, model_dir):
    logger.info("Saving the model.")
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "model.pth")
    # Recommended way from http://pytorch.org/docs/master/notes/serialization.html
    torch.save(model.cpu().state_dict(), path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()

    # Hyperparameters sent by the client are passed as command-line arguments to the script.
    parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train (default: 10)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="input batch size for training (default: 64)")
    parser.add_argument("--lr", type=float, default=0.003, metavar="LR", help="learning rate (default: 0.003)")
    parser.add_argument("--hidden", type=int, default=128, metavar="N", help="hidden layer width (default: 128)")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N", help="batches to wait before logging training status")

    # Data, model, and output directories
    parser.add_argument("--model-dir", type=str, default=os.environ["SM_MODEL_DIR"])
    parser.add_argument("--train", type=str, default=os.environ["SM_CHANNEL_TRAIN"])
    parser.add_argument("--output-data-dir", type=str, default=os.environ["SM_OUTPUT_DATA_DIR"])
    parser.add_argument("--num-gpus", type=int, default=int(os.environ["SM_NUM_GPUS"]))

    # SM_HPS holds the same hyperparameters as JSON; here it supplies the defaults, so they
    # apply whether or not they are also given on the command line (explicit arguments win).
    hyperparameters = json.loads(os.environ["SM_HPS"])
    known = {action.dest for action in parser._actions}
    parser.set_defaults(**{k.replace("-", "_"): v for k, v in hyperparameters.items() if k.replace("-", "_") in known})
    args = parser.parse_args()
    logger.info("Hyperparameters (SM_HPS): %s", hyperparameters)
    logger.info("Number of GPUs (SM_NUM_GPUS): %d", args.num_gpus)

    train(args)
