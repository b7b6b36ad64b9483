"""Run the whole system on one machine: the web server, the scheduler and one local runner."""

import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

from e31web import demo


class Command(BaseCommand):
    help = "Migrate, create the demo data, and run the web server, the scheduler and a local runner until Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("E31_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("E31_PORT", "8000")))
        parser.add_argument("--devices", type=int, default=int(os.environ.get("E31_DEVICES", "2")), help="devices the local runner offers")

    def handle(self, *args, host, port, devices, **options):
        call_command("migrate", interactive=False, verbosity=0)
        made = demo.seed()
        python = sys.executable
        manage = str(settings.BASE_DIR / "manage.py")
        commands = {
            "web": [python, "-m", "daphne", "-b", host, "-p", str(port), "e31web.asgi:application"],
            "scheduler": [python, manage, "scheduler"],
            "runner": [python, manage, "runner", "--devices", str(devices), "--name", "local"],
        }
        children = {name: subprocess.Popen(cmd, cwd=settings.BASE_DIR) for name, cmd in commands.items()}
        stopping = []
        signal.signal(signal.SIGINT, lambda *a: stopping.append(1))
        signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))

        url = f"http://{host}:{port}/"
        self.stdout.write(
            self.style.SUCCESS(f"\nE31 Network is running at {url}\n")
            + f"  log in as {demo.DEMO_USER[0]} / {demo.DEMO_USER[1]} (team {made['team'].name!r})\n"
            + f"  operator (admin at {url}admin/): {demo.OPERATOR[0]} / {demo.OPERATOR[1]}\n"
            + f"  a local runner offers {devices} device(s); data and logs live in {settings.VAR_DIR}\n"
            + "  try: New job, upload examples/digits/train.py, pick the 'digits' dataset. Ctrl-C stops everything.\n"
        )
        failed = None
        while not stopping:
            time.sleep(0.5)
            # Ctrl-C reaches the children too, and they may be gone before this wakes: only a
            # child that ended while no one asked for a stop is a failure.
            if stopping:
                break
            failed = next((name for name, child in children.items() if child.poll() is not None), None)
            if failed:
                break
        if failed:
            self.stderr.write(f"{failed} exited with code {children[failed].returncode}; stopping the rest")
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in children.values():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        self.stdout.write("E31 Network stopped.")
        if failed:
            sys.exit(1)
