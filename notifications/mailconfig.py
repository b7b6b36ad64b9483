"""Email settings from the environment: pure, imported by e31web/settings.py."""

from urllib.parse import parse_qs, unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

CONSOLE = "django.core.mail.backends.console.EmailBackend"
SMTP = "django.core.mail.backends.smtp.EmailBackend"
TRUE = {"1", "true", "yes", "on"}


def email_settings(url=None, host=None, port=25, user="", password="", use_tls=False):
    """Django's EMAIL_* settings: from an EMAIL_URL (smtp://, smtps://, console://), else from
    EMAIL_HOST and its companions, else the console backend (the embedded default)."""
    if url:
        parsed = urlparse(url)
        if parsed.scheme == "console":
            return {"EMAIL_BACKEND": CONSOLE}
        if parsed.scheme not in ("smtp", "smtps") or not parsed.hostname:
            raise ImproperlyConfigured(f"EMAIL_URL={url!r} must be smtp://[user:password@]host[:port][?tls=1], smtps://... or console://")
        query = {k: v[-1].lower() for k, v in parse_qs(parsed.query).items()}
        ssl = parsed.scheme == "smtps"
        return {
            "EMAIL_BACKEND": SMTP,
            "EMAIL_HOST": parsed.hostname,
            "EMAIL_PORT": parsed.port or (465 if ssl else 25),
            "EMAIL_HOST_USER": unquote(parsed.username or ""),
            "EMAIL_HOST_PASSWORD": unquote(parsed.password or ""),
            "EMAIL_USE_SSL": ssl,
            "EMAIL_USE_TLS": not ssl and query.get("tls", "") in TRUE,
            "EMAIL_TIMEOUT": 10,
        }
    if host:
        return {
            "EMAIL_BACKEND": SMTP,
            "EMAIL_HOST": host,
            "EMAIL_PORT": port,
            "EMAIL_HOST_USER": user,
            "EMAIL_HOST_PASSWORD": password,
            "EMAIL_USE_TLS": use_tls,
            "EMAIL_TIMEOUT": 10,
        }
    return {"EMAIL_BACKEND": CONSOLE}
