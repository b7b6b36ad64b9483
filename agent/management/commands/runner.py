import os
import socket
import subprocess

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from agent.runner import AllocationAgent, Runner
from core.signals import stop_on_signals


class Command(BaseCommand):
    help = "Offer this machine's devices (GPUs, or CPU slots without CUDA) and run the jobs placed on them."
    # Django's checks load every URL module (the views, DRF, Optuna): a third of a second, paid
    # on the meter by an agent that starts inside a Slurm job. The web and `bin/up` run them.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):
        parser.add_argument("--devices", type=int, help="how many devices (GPUs or CPU slots) to offer")
        parser.add_argument(
            "--allocation",
            help="run this one allocation a cluster engine started here (E31_EXECUTOR=slurm: the scheduler submits this), then exit",
        )
        parser.add_argument("--name", default=os.environ.get("E31_RUNNER_NAME") or socket.gethostname())
        parser.add_argument("--work-dir", help="where jobs run (default: E31_RUNNER_WORK_DIR; with --allocation, E31_ENGINE_WORK_DIR)")
        parser.add_argument("--device-type", default=None, help="override the detected type (e.g. 'cpu')")
        parser.add_argument(
            "--address",
            default=settings.E31_RUNNER_ADDRESS,
            help="where the other runners of a run across nodes reach this one (default: E31_RUNNER_ADDRESS, 127.0.0.1)",
        )

    def handle(self, *args, devices, name, work_dir, device_type, address, allocation, **options):
        if allocation:
            return self.run_one(allocation, work_dir)
        if devices is None or devices < 1:
            raise CommandError("--devices must be at least 1")
        runner = Runner(name=name, devices=devices, work_dir=work_dir or settings.RUNNER_WORK_DIR, device_type=device_type, address=address)

        def stop():
            runner.shutdown = True

        with stop_on_signals(stop):
            try:
                runner.register()
            except RuntimeError as error:
                raise CommandError(str(error)) from None
            self.stdout.write(f"runner {name}: offering {devices} {runner.device_type} device(s)")
            runner.run()
        self.stdout.write(f"runner {name}: stopped")

    def run_one(self, allocation, work_dir):
        """Inside an engine's job: run the allocation as a runner would, then exit."""
        from scheduler.engine import agent_start, script_start
        from scheduler.executors.configured import get_executor

        agent = AllocationAgent(allocation, work_dir or settings.E31_ENGINE_WORK_DIR)
        # The meter from the engine's start: the batch script's first instant where it falls in
        # the whole second the engine says it started the job, else that second (agent_start).
        script_at = script_start(os.environ.get("E31_ENGINE_STARTED_AT"))
        executor, handle = get_executor(), os.environ.get("SLURM_JOB_ID")
        engine_at = None
        if executor is not None and handle:
            try:
                engine_at = executor.status([handle])[handle].started_at
            except (OSError, subprocess.SubprocessError):  # the controller did not answer in time: the script's word
                if script_at is None:
                    raise
        started_at, precise = agent_start(script_at, engine_at)
        agent.attach(started_at, precise=precise)

        with stop_on_signals(agent.terminate):
            self.stdout.write(f"agent: allocation {agent.allocation_id} on {agent.name}")
            agent.run()
        self.stdout.write(f"agent: allocation {agent.allocation_id} done")
