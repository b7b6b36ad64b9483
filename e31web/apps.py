from django.apps import AppConfig
from django.db.backends.signals import connection_created


class E31WebConfig(AppConfig):
    name = "e31web"
    verbose_name = "E31 Network"

    def ready(self):
        from core.sqltime import use_utc_loader

        connection_created.connect(use_utc_loader, dispatch_uid="e31-utc-loader")
