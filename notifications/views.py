"""The team's webhooks: members see them and their delivery log; only owners change them."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts.access import get_for_team, is_owner, require_team
from accounts.forms import TimeZoneForm
from notifications import events
from notifications.forms import WebhookForm
from notifications.models import Webhook
from notifications.settings_page import render_settings, save_email_preferences

OWNERS_ONLY = "Only the team's owners change its webhooks."


@login_required
@require_http_methods(["GET", "POST"])
def user_settings(request):
    """The user's time zone and what they are emailed about; the team's webhooks (owners
    change them, through notifications.views). Each form posts its own `form` name."""
    require_team(request.user)
    membership = request.user.membership
    posted = request.POST.get("form") if request.method == "POST" else None
    if posted == "email":
        email_form, saved = save_email_preferences(request)
        if saved:
            messages.success(request, "Email notifications saved.")
            return redirect("settings")
        return render_settings(request, email_form=email_form)
    form = TimeZoneForm(request.POST or None, initial={"time_zone": membership.time_zone})
    if request.method == "POST" and form.is_valid():
        membership.time_zone = form.cleaned_data["time_zone"]
        membership.save(update_fields=["time_zone"])
        messages.success(request, f"Time zone set to {membership.time_zone or 'the site’s'}.")
        return redirect("settings")
    return render_settings(request, form=form)


def require_owner(user):
    require_team(user)
    if not is_owner(user):
        raise PermissionDenied(OWNERS_ONLY)


def get_webhook(request, webhook_id, change=False):
    """The team's webhook (404 for another team's); PermissionDenied for a member who would change it."""
    webhook = get_for_team(Webhook.objects, request.user, pk=webhook_id)
    if change:
        require_owner(request.user)
    return webhook


def show_secret(request, webhook, verb):
    messages.success(
        request,
        f"Webhook {verb}. Its secret, shown this once (copy it now; rotate it if it is lost): {webhook.secret}",
    )


@login_required
@require_POST
def webhook_add(request):
    require_owner(request.user)
    form = WebhookForm(request.POST)
    if not form.is_valid():
        return render_settings(request, webhook_form=form)
    webhook = Webhook.objects.create(
        team=request.user.membership.team,
        url=form.cleaned_data["url"],
        kinds=form.cleaned_data["kinds"],
        active=form.cleaned_data["active"],
        created_by=request.user,
    )
    show_secret(request, webhook, "added")
    return redirect("notifications:webhook", webhook_id=webhook.pk)


@login_required
@require_http_methods(["GET", "POST"])
def webhook_detail(request, webhook_id):
    """The webhook and its delivery log; an owner's POST changes its URL, events or state."""
    webhook = get_webhook(request, webhook_id, change=request.method == "POST")
    form = WebhookForm(request.POST or None, initial={"url": webhook.url, "kinds": webhook.kinds, "active": webhook.active})
    if request.method == "POST" and form.is_valid():
        webhook.url, webhook.kinds, webhook.active = form.cleaned_data["url"], form.cleaned_data["kinds"], form.cleaned_data["active"]
        webhook.save(update_fields=["url", "kinds", "active"])
        messages.success(request, "Webhook saved.")
        return redirect("notifications:webhook", webhook_id=webhook.pk)
    deliveries = webhook.deliveries.select_related("notification")[:100]
    context = {"webhook": webhook, "form": form, "deliveries": deliveries, "can_change_webhooks": is_owner(request.user)}
    return render(request, "notifications/webhook.html", context, status=400 if form.errors else 200)


@login_required
@require_POST
def webhook_delete(request, webhook_id):
    webhook = get_webhook(request, webhook_id, change=True)
    webhook.delete()
    messages.success(request, f"Webhook {webhook.url} removed.")
    return redirect("settings")


@login_required
@require_POST
def webhook_rotate(request, webhook_id):
    webhook = get_webhook(request, webhook_id, change=True)
    webhook.rotate_secret()
    show_secret(request, webhook, "secret rotated")
    return redirect("notifications:webhook", webhook_id=webhook.pk)


@login_required
@require_POST
def webhook_test(request, webhook_id):
    webhook = get_webhook(request, webhook_id, change=True)
    events.send_test(webhook, request.user)
    messages.success(request, "A test event is on its way; its delivery shows below within seconds.")
    return redirect("notifications:webhook", webhook_id=webhook.pk)


@login_required
@require_GET
def webhook_list(request):
    return redirect("settings")
