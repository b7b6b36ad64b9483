"""Pipeline parallelism with torch.distributed.pipelining: a small MLP cut into two stages.

Run it under torchrun with two processes, one per stage (gloo on the CPU, nccl on GPUs):

    python -m torch.distributed.run --standalone --nproc-per-node=2 examples/pipeline/train.py

Process 0 holds the first half of the layers and process 1 the second half plus the loss. Each
step, ScheduleGPipe cuts the batch into microbatches, sends activations forward from stage 0 to
stage 1 and gradients back; each process then steps its own optimizer over its own layers.
The data are synthetic: inputs drawn at random, labelled by a fixed random "teacher" network,
so the loss falls quickly.

As an E31 job it reads its settings from the JSON file at $E31_CONFIG (when set), logs the loss
from rank 0 with e31.log_metric, polls e31.should_stop() every step (all stages stop at the same
step), and each stage writes its weights to $E31_OUTPUT_DIR (./output outside a job) as
stage0.pt and stage1.pt.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import e31

DEFAULTS = {"steps": 30, "batch_size": 64, "microbatches": 4, "lr": 0.01, "features": 16, "hidden": 64, "classes": 4, "seed": 0}
STAGES = 2


def load_config():
    config = dict(DEFAULTS)
    path = os.environ.get("E31_CONFIG")
    if path and Path(path).exists():
        config.update(json.loads(Path(path).read_text() or "{}"))
    return config


def build_stages(config):
    """Both stages, built identically in every process (same seed); each process keeps its own."""
    torch.manual_seed(config["seed"])
    features, hidden, classes = config["features"], config["hidden"], config["classes"]
    first = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
    second = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    return [first, second]


def batch(config, step, device):
    """The step's synthetic batch: a function of (seed, step), the same in every process."""
    generator = torch.Generator().manual_seed(config["seed"] * 1_000_003 + step)
    x = torch.randn(config["batch_size"], config["features"], generator=generator)
    teacher = torch.Generator().manual_seed(12345)
    w = torch.randn(config["features"], config["classes"], generator=teacher)
    return x.to(device), (x @ w).argmax(dim=1).to(device)


def main():
    e31.should_stop()  # installs the SIGTERM handler now
    config = load_config()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != STAGES:
        raise SystemExit(f"error: run this with {STAGES} processes (torchrun --nproc-per-node={STAGES}), one per stage; got {world}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend)
    try:
        train(config, rank, device)
    finally:
        dist.destroy_process_group()


def train(config, rank, device):
    last = rank == STAGES - 1
    module = build_stages(config)[rank].to(device)
    stage = PipelineStage(module, stage_index=rank, num_stages=STAGES, device=device)
    schedule = ScheduleGPipe(stage, n_microbatches=config["microbatches"], loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=config["lr"])
    if rank == 0:
        print(f"pipeline: {STAGES} stages on {device.type} ({dist.get_backend()}); config {config}", flush=True)

    for step in range(1, config["steps"] + 1):
        x, y = batch(config, step, device)
        optimizer.zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        # The loss lives on the last stage; rank 0 (the one that writes metrics) gets it from there.
        loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=device)
        dist.broadcast(loss, src=STAGES - 1)
        e31.log_metric(step, loss=loss.item())
        stop = torch.tensor(1.0 if e31.should_stop() else 0.0, device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every stage stops at the same step
        if stop.item():
            if rank == 0:
                print(f"stopping at step {step}: {e31.stop_reason()}", flush=True)
            break

    out = Path(os.environ.get("E31_OUTPUT_DIR") or "output")
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.cpu() for k, v in module.state_dict().items()}, out / f"stage{rank}.pt")


if __name__ == "__main__":
    main()
