from django.apps import AppConfig

from jobs import compute


class SchedulerConfig(AppConfig):
    name = "scheduler"
    verbose_name = "Scheduler and runners"

    def ready(self):
        compute.register(nodes_compute)


def nodes_compute():
    # Imported on first use, not when the app loads: predictions bring in the services (and
    # through them DRF), which a node agent starting inside a Slurm job never needs.
    from scheduler.predictions import NodesCompute

    return NodesCompute()
