"""What every endpoint under /api/ shares: the error shape, pagination and the rate limit.

Every 4xx and 5xx answer of the API is JSON of one shape:

    {"detail": "<one sentence a person can act on>", "errors": {"<field>": ["<message>", ...]}}

"errors" only where fields are at fault; some endpoints add keys of their own (an upload's
"received", a job's "state", a throttled call's "retry_after").
"""

from django.core.paginator import EmptyPage, Paginator
from django.http import JsonResponse
from django.views import defaults
from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import exception_handler as drf_exception_handler

NON_FIELD = "non_field_errors"


# The error shape ------------------------------------------------------------------------------


def sentence(text):
    """A message as a sentence: capitalised, ending with a full stop."""
    text = str(text).strip()
    if not text:
        return text
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else f"{text}."


def field_errors(detail):
    """A ValidationError's detail (a dict, a list or a message) as {field: [messages]}."""
    if isinstance(detail, dict):
        errors = {}
        for field, messages in detail.items():
            field = NON_FIELD if field == "__all__" else str(field)
            errors.setdefault(field, []).extend(_messages(messages))
        return errors
    return {NON_FIELD: _messages(detail)}


def _messages(value):
    """Every message in a (possibly nested) error detail, as strings."""
    if isinstance(value, dict):
        return [f"{key}: {message}" for key, inner in value.items() for message in _messages(inner)]
    if isinstance(value, (list, tuple)):
        return [message for item in value for message in _messages(item)]
    return [str(value)]


def refusal(errors):
    """The detail sentence of field errors: 'The request was refused: gpus: Ask for at least 1 GPU.'"""
    parts = []
    for field, messages in errors.items():
        text = " ".join(sentence(m) for m in messages)
        parts.append(text if field == NON_FIELD else f"{field}: {text}")
    return sentence("The request was refused: " + " ".join(parts)) if parts else "The request was refused."


def fields(request):
    """The request's body as fields: a JSON object or a form; anything else is a 400."""
    from rest_framework.exceptions import ValidationError

    if not hasattr(request.data, "get"):
        raise ValidationError({"non_field_errors": ["Send the fields as a JSON object or as form data."]})
    return request.data


def error_body(detail, errors=None, **extra):
    body = {"detail": sentence(detail)}
    if errors:
        body["errors"] = errors
    body.update(extra)
    return body


def form_errors_response(form_or_errors, status_code=status.HTTP_400_BAD_REQUEST, **extra):
    """A form's errors (or a {field: [messages]} dict) as the API's 400 answer."""
    raw = form_or_errors.errors if hasattr(form_or_errors, "errors") else form_or_errors
    errors = field_errors({field: list(messages) for field, messages in raw.items()})
    return Response(error_body(refusal(errors), errors, **extra), status=status_code)


def _allowed(view):
    methods = getattr(view, "allowed_methods", None) or []
    return [m for m in methods if m != "OPTIONS"] or methods


def _media_types(view):
    parsers = getattr(view, "parser_classes", None) or api_settings.DEFAULT_PARSER_CLASSES
    return [parser.media_type for parser in parsers]


def _detail(exc, view):
    """The sentence for an exception of DRF's (other than a ValidationError)."""
    if isinstance(exc, exceptions.NotAuthenticated):
        return "Authentication is needed: send your API token as 'Authorization: Token <key>' (or sign in)."
    if isinstance(exc, exceptions.AuthenticationFailed):
        return f"{sentence(exc.detail)} Send a valid API token as 'Authorization: Token <key>'."
    if isinstance(exc, exceptions.MethodNotAllowed):
        allowed = ", ".join(_allowed(view)) or "no method"
        return f"{exc.detail} This address answers {allowed}."
    if isinstance(exc, exceptions.UnsupportedMediaType):
        return f"{exc.detail} Send the body as one of: {', '.join(_media_types(view))}."
    if isinstance(exc, exceptions.ParseError):
        return f"The request body could not be read: {exc.detail}"
    if isinstance(exc, exceptions.NotAcceptable):
        return f"{exc.detail} This address answers application/json."
    if isinstance(exc, exceptions.Throttled):
        if exc.wait is None:
            return "Too many requests: slow down and try again later."
        return f"Too many requests: try again in {max(1, round(exc.wait))} seconds."
    if isinstance(exc, exceptions.NotFound) and str(exc.detail) in ("Not found.", "No Http404 matches the given query."):
        return "Nothing is at this address: check the id in the URL."
    detail = exc.detail
    if isinstance(detail, dict):
        detail = detail.get("detail", " ".join(_messages(detail)))
    elif isinstance(detail, list):
        detail = " ".join(_messages(detail))
    return str(detail)


def exception_handler(exc, context):
    """DRF's handler, answering in the API's shape (settings.REST_FRAMEWORK's EXCEPTION_HANDLER).

    Exceptions that are not the client's (a bug, the database away) are left to Django, which
    logs them and answers with handler500 below: a 500 in the same shape."""
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    view = context.get("view")
    if isinstance(exc, exceptions.ValidationError):
        errors = field_errors(exc.detail)
        response.data = error_body(refusal(errors), errors)
        return response
    extra = {}
    if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
        extra["retry_after"] = max(1, round(exc.wait))
        response["Retry-After"] = str(extra["retry_after"])
    original = exc if isinstance(exc, exceptions.APIException) else None
    if original is None:  # Http404 / Django's PermissionDenied, already converted by DRF
        original = exceptions.NotFound(*exc.args) if response.status_code == 404 else exceptions.PermissionDenied(*exc.args)
    response.data = error_body(_detail(original, view), **extra)
    return response


# Django's own errors under /api/ (no such route, a crash): JSON too ----------------------------------


def is_api(request):
    return request.path.startswith("/api/")


def _json_error(detail, status_code):
    return JsonResponse(error_body(detail), status=status_code)


def page_not_found(request, exception, template_name=defaults.ERROR_404_TEMPLATE_NAME):
    if is_api(request):
        return _json_error("Nothing is at this address: see /api/docs/ for the API's endpoints.", 404)
    return defaults.page_not_found(request, exception, template_name)


def server_error(request, template_name=defaults.ERROR_500_TEMPLATE_NAME):
    if is_api(request):
        return _json_error("The server failed to answer this request; it has been logged. Try again later.", 500)
    return defaults.server_error(request, template_name)


def bad_request(request, exception, template_name=defaults.ERROR_400_TEMPLATE_NAME):
    if is_api(request):
        return _json_error("The request is malformed (or too large) and was refused.", 400)
    return defaults.bad_request(request, exception, template_name)


def permission_denied(request, exception, template_name=defaults.ERROR_403_TEMPLATE_NAME):
    if is_api(request):
        return _json_error(str(exception) or "You may not do this.", 403)
    return defaults.permission_denied(request, exception, template_name)


# Pagination -----------------------------------------------------------------------------------


def _page_param(request, name, default, maximum=None):
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    try:
        number = int(raw)
    except ValueError:
        number = 0
    if number < 1 or (maximum is not None and number > maximum):
        limit = f"from 1 to {maximum}" if maximum is not None else "1 or more"
        raise exceptions.ValidationError({name: [f"Give a whole number {limit}, not {raw!r}."]})
    return number


def page_of(request, items, to_json, default_size=50, max_size=200, prepare=None, release=None):
    """The page of items that ?page=N&page_size=M asks for, as {count, next, previous, results}
    (prepare: called with the page's items, as a list, before they are written; release: after).

    Page 1 is always there (empty when there is nothing); a page past the last one is a 404."""
    size = _page_param(request, "page_size", default_size, max_size)
    number = _page_param(request, "page", 1)
    paginator = Paginator(items, size)
    try:
        page = paginator.page(number)
    except EmptyPage:
        raise exceptions.NotFound(f"There is no page {number}: the last page is {paginator.num_pages}.") from None

    def link(n):
        query = request.query_params.copy()
        query["page"] = str(n)
        return request.build_absolute_uri(f"{request.path}?{query.urlencode()}")

    shown = list(page.object_list)
    if prepare is not None:
        prepare(shown)
    results = [to_json(item) for item in shown]
    if release is not None:
        release(shown)
    return {
        "count": paginator.count,
        "next": link(page.next_page_number()) if page.has_next() else None,
        "previous": link(page.previous_page_number()) if page.has_previous() else None,
        "results": results,
    }


def paginate(request, items, to_json, default_size=50, max_size=200, prepare=None, release=None):
    """A list endpoint's answer: {"count", "next", "previous", "results"} (see page_of)."""
    return Response(page_of(request, items, to_json, default_size=default_size, max_size=max_size, prepare=prepare, release=release))


# The OpenAPI schema (descriptions of the views: e31web/api_schema.py) ----------------------------


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's, telling apart the two routes of one view (an invoice's .pdf and .csv)."""

    def get_operation_id(self):
        for ext in (".pdf", ".csv"):
            if self.path.endswith(ext):
                return f"invoice_{ext[1:]}"
        return super().get_operation_id()
