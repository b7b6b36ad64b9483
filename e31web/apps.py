from django.apps import AppConfig


class E31WebConfig(AppConfig):
    name = "e31web"
    verbose_name = "E31 Network"
