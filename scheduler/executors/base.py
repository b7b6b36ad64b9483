"""What the scheduler needs from compute, whoever holds it: the nodes and their free devices;
start an allocation on chosen nodes; learn that it started, ended or lost its node; stop it.

Plain data and a Protocol, no Django. The local runner (our agent on each node) and a cluster
engine (Slurm first, Kubernetes later) each implement Executor; the placement policy, the meter
and what a team sees do not change with it.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

# A node's state, as far as placing work goes.
UP = "up"  # offered: its free devices may be placed on
DRAINED = "drained"  # taken out of service by its operator (running work may finish); not offered
DOWN = "down"  # not responding or failed; not offered

# An allocation's state.
PENDING = "pending"  # submitted, waiting for the engine to start it (compute not held yet)
RUNNING = "running"  # compute held: the meter runs
ENDED = "ended"  # the command finished by itself (its exit code says how) or reached its time limit
FAILED = "failed"  # the command failed, or the engine could not run it
CANCELLED = "cancelled"  # stopped on request
NODE_LOST = "node_lost"  # the engine lost a node or took the compute back: requeue and credit the lost time
UNKNOWN = "unknown"  # the engine no longer knows the handle (purged, accounting off)

FINISHED = frozenset({ENDED, FAILED, CANCELLED, NODE_LOST, UNKNOWN})


@dataclass(frozen=True)
class NodeInfo:
    """One node as the engine reports it. Devices busy with anyone's work (another user of the
    cluster, or E31 itself) are not free; a node that is not up has nothing free."""

    name: str
    device_type: str  # "gpu" or "cpu": what the slots are
    devices: int  # GPUs, or CPUs on a CPU node
    free: int
    memory_mb: int
    free_memory_mb: int
    state: str = UP
    reason: str = ""  # why it is drained or down, as its operator or the engine wrote it
    gpu_type: str = ""  # the GPU model where the engine names one (gres gpu:a100:4)
    partitions: tuple[str, ...] = ()


@dataclass(frozen=True)
class AllocationRequest:
    """One E31 allocation for an engine to run: the nodes the policy chose and what to hold on
    each, and the command (an argument list, never a shell string) to run once on each node."""

    allocation_id: str | int
    job_id: str | int
    nodes: tuple[str, ...]
    command: tuple[str, ...]
    workdir: str
    time_limit_seconds: int  # the span (or ceiling) E31 stops the job at itself
    grace_seconds: int  # after a graceful stop signal, before the engine kills the command
    gpus_per_node: int = 0  # GPUs per node; 0 on CPU nodes, which hold cpus_per_node instead
    cpus_per_node: int = 1
    memory_mb: int = 0  # per node; 0 leaves it to the engine's default
    account: str | None = None  # the team's account on the engine, where the operator maps one
    environment: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AllocationStatus:
    state: str
    started_at: datetime | None = None  # compute held from (the meter's start)
    ended_at: datetime | None = None
    exit_code: int | None = None
    signal: int | None = None  # the signal that ended the command, where one did
    reason: str = ""  # the engine's word for why it waits or how it ended
    engine_state: str = ""  # the engine's own state name (Slurm's JobState)

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


class Executor(Protocol):
    def nodes(self) -> list[NodeInfo]:
        """The nodes E31 may place on, with their free devices now."""
        ...

    def start(self, request: AllocationRequest) -> str:
        """Submit the allocation; returns the engine's handle for it (which the caller records)."""
        ...

    def status(self, handles: Iterable[str]) -> dict[str, AllocationStatus]:
        """The state of each handle this executor started."""
        ...

    def stop(self, handle: str, graceful: bool = True) -> None:
        """Ask the command to stop (graceful: a TERM it may trap to checkpoint; the caller stops
        it for good once its grace is over), or end it now. Only handles this executor made."""
        ...

    def accounted(self, handles: Iterable[str]) -> dict[str, AllocationStatus]:
        """What the engine's accounting recorded of these (Slurm: sacct), {} where it keeps none:
        the record the meter is reconciled with once the engine has ended a job."""
        ...


# Engines count seconds whole (Slurm's start and end are truncated to the second), so the compute
# really held is within a second of the engine's elapsed time either way: a meter over it by more
# than that billed what was not held. Under it is allowed a second more: the meter stops when the
# job ends, the engine's clock when our agent has exited after it.
AGREE_SECONDS = 1.0
UNDER_SECONDS = 2.0


def disagreement(held_seconds: float, engine_seconds: float | None) -> float | None:
    """Seconds by which the meter and the engine's accounting differ, when more than the engine's
    whole seconds explain (over by AGREE_SECONDS, under by UNDER_SECONDS)."""
    if engine_seconds is None:
        return None
    difference = held_seconds - engine_seconds
    return difference if difference > AGREE_SECONDS or difference < -UNDER_SECONDS else None
