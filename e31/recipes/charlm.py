"""The charlm recipe: a small byte-level causal transformer.  python -m e31.recipes.charlm

Data: the *.txt files under $E31_DATA_DIR/train/ (read as bytes, in name order, joined); validation
on those under heldout/, else on the last 10% of the training bytes. The vocabulary is the 256
byte values, so any text (any encoding) works and every model of this recipe shares it.
Validation is deterministic: fixed windows of context + 1 bytes, taken every `context` bytes
(at most eval_windows of them, evenly spread); val_loss is the mean cross-entropy per byte,
val_bpb the same in bits.
"""

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from e31.recipes import common

NAME = "charlm"
VOCAB = 256
EVAL_BATCH = 64
HOLDOUT_FRACTION = 0.1


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, context: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(VOCAB, d_model)
        self.positions = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        x = self.tokens(idx) + self.positions(torch.arange(length, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(info: dict[str, Any]) -> CharLM:
    arch = info["architecture"]
    if arch.get("vocab", VOCAB) != VOCAB:
        common.fail(f"the model's vocabulary has {arch['vocab']} entries; this recipe is byte-level ({VOCAB})")
    if arch["d_model"] % arch["n_heads"]:
        common.fail(f"the model's n_heads ({arch['n_heads']}) does not divide its d_model ({arch['d_model']})")
    return CharLM(arch["context"], arch["d_model"], arch["n_layers"], arch["n_heads"])


# -- data -------------------------------------------------------------------------------------


def read_text(folder: str | os.PathLike[str]) -> torch.Tensor | None:
    """The bytes of the *.txt files under folder, in path order; None when there are none."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*.txt") if p.is_file()) if folder.is_dir() else []
    if not files:
        return None
    data = b"".join(p.read_bytes() for p in files)
    return torch.tensor(list(data), dtype=torch.long) if len(data) < 1024 else torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    root = common.data_dir()
    train = read_text(root / "train")
    if train is None or len(train) == 0:
        common.fail(f"no text in {root / 'train'} (expected *.txt files)")
    heldout = read_text(root / "heldout")
    if heldout is not None and len(heldout):
        return train, heldout
    cut = len(train) - max(1, int(len(train) * HOLDOUT_FRACTION))
    return train[:cut], train[cut:]


def window_starts(length: int, context: int, limit: int) -> torch.Tensor:
    """Start offsets of the fixed validation windows (context + 1 bytes each)."""
    count = (length - 1) // context
    if count < 1:
        common.fail(f"the validation text has {length} bytes; windows of context + 1 = {context + 1} bytes need more")
    starts = np.arange(count) * context
    if count > limit:
        starts = starts[np.unique(np.linspace(0, count - 1, limit).round().astype(np.int64))]
    return torch.from_numpy(starts)


@torch.no_grad()
def score(model: nn.Module, text: torch.Tensor, starts: torch.Tensor, context: int, device: torch.device) -> tuple[common.Metrics, list[float]]:
    """(metrics, mean loss of each window): val_loss, val_bpb over the fixed windows."""
    model.eval()
    offsets = torch.arange(context + 1)
    per_window: list[torch.Tensor] = []
    for first in range(0, len(starts), EVAL_BATCH):
        rows = text[starts[first : first + EVAL_BATCH, None] + offsets].to(device)
        with common.autocast(device):
            logits = model(rows[:, :-1]).float()
        losses = F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1), reduction="none")
        per_window.append(losses.view(len(rows), context).double().mean(dim=1))
    windows = torch.cat(per_window)
    loss = windows.mean().item()
    return {"loss": loss, "bpb": loss / math.log(2)}, windows.cpu().tolist()


def evaluate_staged(config: common.Config) -> None:
    device = common.pick_device()
    heldout = read_text(common.data_dir() / "heldout")
    if heldout is None or not len(heldout):
        common.fail(f"evaluate mode needs *.txt files in {common.data_dir() / 'heldout'}")
    models: list[tuple[str, CharLM]] = []
    for label, info, state in common.staged_models(NAME):
        models.append((label, common.staged_model(build_model, label, info, state).to(device)))
    # One set of windows for every model (per_example must line up): the shortest context fits all.
    context = min(model.context for _, model in models)
    starts = window_starts(len(heldout), context, config["eval_windows"])
    results = {label: score(model, heldout, starts, context, device) for label, model in models}
    common.write_evaluation(NAME, "loss", False, results)


# -- training ---------------------------------------------------------------------------------


def whole_model(info: dict[str, Any], config: common.Config, weights: dict[str, Any]) -> CharLM:
    """A plain (unsharded, CPU) copy of the trained model, LoRA adapters included, from its full state."""
    model = build_model(info)
    if config["adaptation"] == "lora":
        common.apply_lora(model, config["lora_rank"], config["lora_alpha"])
    model.load_state_dict(weights)
    return model


def train(config: common.Config, dist: common.Dist) -> None:
    start, start_info = common.starting_model(NAME)
    arch = {k: config[k] for k in ("context", "d_model", "n_layers", "n_heads")}
    if start_info is not None:
        arch = {k: start_info["architecture"][k] for k in arch}
    info = {"recipe": NAME, "format": common.FORMAT, "architecture": {"vocab": VOCAB, **arch}, "data": {"vocab": "bytes", "vocab_size": VOCAB}}
    context, batch_size, seed = arch["context"], config["batch_size"], config["seed"]

    train_text, val_text = load_data()
    if config["smoke"]:
        train_text = train_text[: common.smoke_count(len(train_text), batch_size * (context + 1))]
    if len(train_text) < context + 1:
        common.fail(f"the training text has {len(train_text)} bytes; the context ({context}) needs at least {context + 1}")
    starts = window_starts(len(val_text), context, config["eval_windows"])
    device = dist.device

    model = common.prepare_model(build_model(info), start, config, device)
    if dist.writer:
        print(
            f"charlm: {len(train_text)} training bytes, {len(starts)} validation windows; "
            f"{'fine-tuning the model in $E31_MODEL_DIR/start' if start else 'from scratch'}; {dist.describe()}; config {config}",
            flush=True,
        )

    offsets = torch.arange(context + 1)

    def train_loss(module: nn.Module, step: int) -> torch.Tensor:
        # The step's windows are a function of (seed, step): a resumed run draws the same ones.
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        firsts = torch.randint(0, len(train_text) - context, (batch_size,), generator=generator)
        rows = train_text[dist.shard(firsts)[:, None] + offsets].to(device)
        logits = module(rows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), rows[:, 1:].reshape(-1))

    def evaluate() -> common.Metrics:
        metrics, _ = score(model, val_text, starts, context, device)
        return {"val_loss": metrics["loss"], "val_bpb": metrics["bpb"]}

    final, stopped = common.fit(model, config, dist, train_loss=train_loss, evaluate=evaluate, finetuning=start is not None)
    weights = dist.model_state(model)  # under FSDP every process takes part in gathering the shards
    if not dist.writer:
        return
    if dist.sharded:
        model = whole_model(info, config, weights)
    common.write_results(model, info, config, final, stopped)


def main() -> None:
    common.main(NAME, train, evaluate_staged)


if __name__ == "__main__":
    main()
