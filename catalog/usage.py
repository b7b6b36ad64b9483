"""Who uses a dataset's versions: what deleting a dataset asks before it goes.

catalog sits below jobs in the layers (pyproject.toml: jobs pin dataset versions), so it does not
import jobs: the jobs app registers its answer here when it loads (jobs.apps), as the scheduler
registers the compute side with jobs (jobs.compute).
"""

from collections.abc import Callable, Iterable

from django.core.exceptions import ImproperlyConfigured

# version ids -> the unfinished users pinning any of them, as (name, short id, state), oldest
# first. Called inside the deleting transaction, after the versions are locked.
Users = Callable[[Iterable], list[tuple[str, str, str]]]

_users: Users | None = None


def register(users: Users) -> None:
    global _users
    _users = users


def unfinished_users(version_ids) -> list[tuple[str, str, str]]:
    if _users is None:
        raise ImproperlyConfigured("nothing tells who uses a dataset: the jobs app (INSTALLED_APPS) registers it when it loads")
    return _users(version_ids)
