"""The operator's executor, from the settings (E31_EXECUTOR and the E31_SLURM_* settings)."""

from django.conf import settings

from scheduler.executors.slurm import SlurmExecutor


def get_executor() -> SlurmExecutor | None:
    """The Slurm executor where E31_EXECUTOR=slurm; None for the local runner, which is still
    the scheduler's own path (scheduler/services.py) and not yet behind the Executor interface."""
    if settings.E31_EXECUTOR != "slurm":
        return None
    return SlurmExecutor(conf=settings.E31_SLURM_CONF, partitions=settings.E31_SLURM_PARTITIONS)


def slurm_account(team_name: str) -> str | None:
    """The team's Slurm account where the operator maps one (E31_SLURM_ACCOUNTS), else None."""
    return settings.E31_SLURM_ACCOUNTS.get(team_name)
