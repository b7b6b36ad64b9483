from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Teams and users"

    def ready(self):
        # An API token made or revoked goes in the audit log whichever way: signing in from the
        # terminal, the admin (its proxy model), `manage.py apitoken`, revoking it.
        # Imported here: models load only once the app registry is ready (ready() is that moment).
        from rest_framework.authtoken.models import Token, TokenProxy

        from accounts import audit

        for model in (Token, TokenProxy):
            post_save.connect(audit.token_saved, sender=model, dispatch_uid=f"audit-{model.__name__}-saved")
            post_delete.connect(audit.token_deleted, sender=model, dispatch_uid=f"audit-{model.__name__}-deleted")
