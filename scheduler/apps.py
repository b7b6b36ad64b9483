from django.apps import AppConfig

from jobs import compute


class SchedulerConfig(AppConfig):
    name = "scheduler"
    verbose_name = "Scheduler and runners"

    def ready(self):
        # Imported here, once the app registry is ready: the services module loads models.
        from scheduler.predictions import NodesCompute

        compute.register(NodesCompute())
