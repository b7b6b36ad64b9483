from django.apps import AppConfig

from catalog import usage


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self):
        # Imported here, once the app registry is ready: the models module loads models.
        from jobs.models import unfinished_users

        usage.register(unfinished_users)
