"""What the job pages ask of the compute side: the device types nodes offer, and when a request
as filled in would start and finish behind today's queue.

jobs sits below scheduler in the layers (pyproject.toml: a job is described before anything
holds compute for it), so it does not import the scheduler: the scheduler app registers its
answers here when it loads (scheduler.apps). Another compute side (a Slurm executor, say) would
register its own.
"""

from collections.abc import Callable
from typing import Protocol

from django.core.exceptions import ImproperlyConfigured


class Compute(Protocol):
    def device_types(self) -> set[str]:
        """The device types of the nodes known to the network."""
        ...

    def predict(self, team, request, **options):
        """(start, finish) of a request behind the queue as it is now, or (None, None) when no
        node could run it (scheduler.predictions.predict_request's options)."""
        ...


_provider: Compute | None = None
_factory: Callable[[], Compute] | None = None


def register(factory: Callable[[], Compute]) -> None:
    """The compute side, made on first use: a process that never asks (a node agent, most
    commands) does not import it, which keeps their start quick."""
    global _provider, _factory
    _provider, _factory = None, factory


def compute() -> Compute:
    global _provider
    if _provider is None:
        if _factory is None:
            raise ImproperlyConfigured("no compute side is registered: the scheduler app (INSTALLED_APPS) registers one when it loads")
        _provider = _factory()
    return _provider
