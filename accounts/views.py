from django.contrib.auth import views as auth_views

from accounts import signin


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
