"""What a process costs to start, where its start is on someone's clock: the node agent inside a
Slurm job (billed from the batch script's first instant), any manage.py command, and the web
worker (whose collector must not walk everything the start made at every full pass)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python(*args):
    """What a fresh Python in the checkout prints, run with the project's settings."""
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "e31web.settings"}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environment, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.nodb
def test_the_agent_starts_without_the_webs_libraries():
    """The agent starts inside the Slurm job, on the meter: Django, the models and the agent, not
    DRF, Twisted, Optuna or the scheduler's predictions, no system checks (they load every URL
    module), not the admin's modules, and not what only later steps need: YAML and the spec
    reader (a smoke run's check), packaging (requirements), psutil (the first reading) and
    cryptography (a sealed secret)."""
    web = ("rest_framework.serializers", "twisted", "daphne", "optuna", "scheduler.predictions", "jobs.admin", "accounts.admin")
    later = ("yaml", "jobs.specfile", "packaging", "psutil", "cryptography")
    code = (
        "import sys, django; django.setup(); import agent.runner; "
        "from agent.management.commands.runner import Command; assert Command.requires_system_checks == []; "
        f"print(' '.join(m for m in {web + later!r} if m in sys.modules) or 'none')"
    )
    assert python("-c", code) == ["none"]


@pytest.mark.nodb
def test_the_admin_has_every_apps_models_once_the_urls_load():
    code = "import django; django.setup(); from django.contrib import admin; before = len(admin.site._registry); import e31web.urls; print(before, len(admin.site._registry) > 10)"
    assert python("-c", code) == ["0", "True"]


@pytest.mark.nodb
def test_manage_py_keeps_the_collector_off_while_a_command_starts_and_on_once_it_runs():
    code = "import gc; print(gc.isenabled(), gc.get_freeze_count() > 10000)"
    assert python("manage.py", "shell", "-v", "0", "-c", code) == ["True", "True"]


@pytest.mark.nodb
def test_the_web_worker_keeps_what_its_start_made_out_of_the_collectors_way():
    assert python("-c", "import gc, e31web.asgi; print(gc.get_freeze_count() > 10000)") == ["True"]
