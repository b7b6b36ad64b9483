import uuid

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from django.utils import timezone


class Team(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    share = models.PositiveIntegerField(default=1, help_text="The team's share of the network for fair share (relative to the other teams' shares).")
    monthly_budget = models.DecimalField(
        max_digits=14,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="The most the team may spend in a calendar month (UTC), in the network's currency; blank: no budget. "
        "Jobs whose worst case would take the month's spend past it wait.",
    )

    def __str__(self):
        return self.name


class Membership(models.Model):
    """A user belongs to exactly one team; everything they see is scoped to it."""

    OWNER = "owner"
    MEMBER = "member"
    ROLES = [(OWNER, "Owner"), (MEMBER, "Member")]

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=ROLES, default=MEMBER)
    time_zone = models.CharField(max_length=64, blank=True, help_text="the user's time zone (IANA name) for the times they enter and see; blank: the site's")

    def __str__(self):
        return f"{self.user} in {self.team} ({self.role})"


# A membership ended or moved to another team, or an API token revoked, however it was done (the
# admin, the shell, a user deleted): the user's open websockets check their access again now.
# Senders by name: the admin deletes tokens through DRF's proxy model.
@receiver(post_delete, sender=Membership, dispatch_uid="sockets-membership-ended")
@receiver(post_save, sender=Membership, dispatch_uid="sockets-membership-changed")
@receiver(post_delete, sender="authtoken.Token", dispatch_uid="sockets-token-revoked")
@receiver(post_delete, sender="authtoken.TokenProxy", dispatch_uid="sockets-token-proxy-revoked")
def access_changed(sender, instance, created=False, update_fields=None, **kwargs):
    if created or (update_fields is not None and "team" not in update_fields):
        return  # a new membership, or a time zone saved: no access is lost
    # Imported here: the websocket side (channels) is not loaded while the models are.
    from accounts import ws_auth

    ws_auth.access_changed(instance.user_id)


class AuditImmutable(Exception):
    """An audit event is never changed nor deleted: the audit log is append-only."""


class AuditQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AuditImmutable("Audit events cannot be changed.")

    def delete(self):
        raise AuditImmutable("Audit events cannot be deleted.")


class AuditEvent(models.Model):
    """Who did what, when, from where: one row per action (accounts.audit.record). Append-only.

    user is None for the system's own actions (a management command issuing invoices): actor
    names the command then; for a refusal without a signed-in user, the name tried (a failed
    sign-in) or "(anonymous)"; otherwise the user's name, kept should the user be deleted. team is
    the team the event concerns: for another team's object asked for, the object's team."""

    ACTIONS = [
        ("job.submit", "Job submitted"),
        ("job.cancel", "Job cancelled"),
        ("job.retrain", "Job retrained"),
        ("job.compare", "Job compared"),
        ("artifact.download", "Artifact downloaded"),
        ("checkpoint.download", "Checkpoint downloaded"),
        ("log.download", "Log downloaded"),
        ("spec.download", "Spec downloaded"),
        ("invoice.issue", "Invoice issued"),
        ("invoice.download", "Invoice downloaded"),
        ("statement.download", "Statement downloaded"),
        ("usage.download", "Usage downloaded"),
        ("dataset.create", "Dataset created"),
        ("dataset.upload.complete", "Dataset upload completed"),
        ("dataset.seal", "Dataset version sealed"),
        ("dataset.credentials", "Dataset credentials changed"),
        ("dataset.delete", "Dataset deleted"),
        ("job.env", "Job environment set (names only)"),
        ("token.create", "API token made"),
        ("token.revoke", "API token revoked"),
        ("signin.fail", "Sign-in failed"),
        ("signin.lockout", "Sign-in locked"),
        ("object.foreign", "Another team's object asked for"),
        ("csrf.fail", "CSRF check failed"),
        ("ws.refuse", "Websocket refused"),
    ]
    # What someone was refused: a burst of these from one address shows on the operator's page.
    REFUSALS = ["signin.fail", "signin.lockout", "object.foreign", "csrf.fail", "ws.refuse"]
    WEB, API, WS, SYSTEM = "web", "api", "ws", "system"
    VIA = [(WEB, "Web"), (API, "API"), (WS, "Websocket"), (SYSTEM, "System")]

    at = models.DateTimeField(default=timezone.now, db_index=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    actor = models.CharField(max_length=150, help_text="the user's name, or the command's for a system action")
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_events")
    action = models.CharField(max_length=40, choices=ACTIONS, db_index=True)
    object_type = models.CharField(max_length=40, blank=True)
    object_id = models.CharField(max_length=100, blank=True)
    label = models.CharField(max_length=300, blank=True)
    via = models.CharField(max_length=10, choices=VIA)
    ip = models.GenericIPAddressField(null=True, blank=True, verbose_name="IP address")

    objects = AuditQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["team", "-at"], name="audit_team_at")]

    def __str__(self):
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.object_type} {self.label or self.object_id}"

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AuditImmutable("An audit event cannot be changed.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AuditImmutable("An audit event cannot be deleted.")
