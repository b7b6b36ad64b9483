import uuid

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models


class Team(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    share = models.PositiveIntegerField(
        default=1, help_text="The team's share of the network for fair share (relative to the other teams' shares)."
    )
    monthly_budget = models.DecimalField(
        max_digits=14, decimal_places=2, null=True, blank=True, validators=[MinValueValidator(0)],
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
    time_zone = models.CharField(
        max_length=64, blank=True, help_text="the user's time zone (IANA name) for the times they enter and see; blank: the site's"
    )

    def __str__(self):
        return f"{self.user} in {self.team} ({self.role})"
