"""Signing in from the terminal: a token for a username and password, and who a token is."""

from django.contrib.auth import authenticate
from rest_framework import status
from rest_framework.authtoken.models import Token
from rest_framework.decorators import (
    api_view,
    authentication_classes,
    parser_classes,
    permission_classes,
)
from rest_framework.parsers import FormParser
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.response import Response

from accounts import signin
from accounts.access import team_of
from accounts.forms import TimeZoneForm
from accounts.permissions import NO_TEAM
from core.api import fields
from core.parsers import BoundedJSONParser


@api_view(["POST"])
@authentication_classes([])
@permission_classes([AllowAny])
@parser_classes([BoundedJSONParser, FormParser])
def token(request):
    """{username, password} -> {token}: the user's API token (made on first use), as `e31 login`
    keeps it; for a team member, or a staff operator (whose token reaches the staff endpoints)."""
    data = fields(request)
    username, password = data.get("username"), data.get("password")
    if not isinstance(username, str) or not isinstance(password, str) or not username or not password:
        return Response(
            {"detail": "Give a username and a password.", "errors": {"username": ["Required."]} if not username else {"password": ["Required."]}},
            status=status.HTTP_400_BAD_REQUEST,
        )
    address = request.META.get("REMOTE_ADDR")
    wait = signin.retry_after(username, address)
    if wait:
        return Response({"detail": signin.refusal(wait), "retry_after": wait}, status=status.HTTP_429_TOO_MANY_REQUESTS, headers={"Retry-After": str(wait)})
    user = authenticate(request._request, username=username, password=password)
    if user is None:
        signin.failed(username, address)
        return Response({"detail": "Wrong username or password."}, status=status.HTTP_401_UNAUTHORIZED)
    signin.succeeded(username, address)
    # A staff operator on no team gets one too: for /metrics; team endpoints refuse it (a 403
    # saying so, accounts.permissions.OnATeam).
    if team_of(user) is None and not user.is_staff:
        return Response({"detail": NO_TEAM}, status=status.HTTP_403_FORBIDDEN)
    key, _ = Token.objects.get_or_create(user=user)
    return Response({"token": key.key, "username": user.username})


@api_view(["GET", "PATCH"])
@permission_classes([IsAuthenticated])  # anyone signed in, a staff operator on no team too
@parser_classes([BoundedJSONParser, FormParser])
def me(request):
    """Who the token (or session) is, and their team. PATCH {time_zone}: the settings page's
    time zone (an IANA name; blank for the site's)."""
    team = team_of(request.user)
    membership = getattr(request.user, "membership", None)
    if request.method == "PATCH":
        data = fields(request)
        unknown = sorted(set(data) - {"time_zone"})
        if unknown:
            return Response({"detail": f"Only time_zone can be changed here, not {', '.join(unknown)}."}, status=status.HTTP_400_BAD_REQUEST)
        zone = data.get("time_zone") or ""
        form = TimeZoneForm({"time_zone": zone if isinstance(zone, str) else None})
        if membership is None or not isinstance(zone, str) or not form.is_valid():
            errors = {"time_zone": [f"{zone!r} is not a time zone (an IANA name such as Europe/Berlin)."]}
            return Response({"detail": errors["time_zone"][0], "errors": errors}, status=status.HTTP_400_BAD_REQUEST)
        membership.time_zone = form.cleaned_data["time_zone"]
        membership.save(update_fields=["time_zone"])
    return Response(
        {
            "username": request.user.get_username(),
            "email": request.user.email,
            "team": {"id": str(team.pk), "name": team.name} if team else None,
            "role": membership.role if membership else None,
            "time_zone": (membership.time_zone if membership else "") or None,
        }
    )
