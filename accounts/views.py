from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect
from django.views.decorators.http import require_http_methods

from accounts import signin
from accounts.access import require_team
from accounts.settings_page import TimeZoneForm, render_settings
from notifications.settings_page import save_email_preferences


class LoginView(auth_views.LoginView):
    """Django's sign-in page, refusing for a while after too many failed attempts (accounts.signin)."""

    redirect_authenticated_user = True

    def post(self, request, *args, **kwargs):
        wait = signin.retry_after(request.POST.get("username", ""), request.META.get("REMOTE_ADDR"))
        if wait:
            context = self.get_context_data(form=self.form_class(request), locked_out=signin.refusal(wait))
            response = self.render_to_response(context, status=429)
            response["Retry-After"] = str(wait)
            return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form):
        signin.failed(self.request.POST.get("username", ""), self.request.META.get("REMOTE_ADDR"))
        return super().form_invalid(form)

    def form_valid(self, form):
        signin.succeeded(form.get_user().get_username(), self.request.META.get("REMOTE_ADDR"))
        return super().form_valid(form)


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
