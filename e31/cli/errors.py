"""What can go wrong, as exit codes a script can act on."""

from typing import Any

OK = 0
JOB_FAILED = 1  # a followed job failed, was stopped or cancelled; or a refused action (409)
USAGE = 2  # a bad command line or spec (HTTP 400)
AUTH = 3  # not logged in, a bad token, not allowed (HTTP 401/403)
NOT_FOUND = 4  # HTTP 404, or no job matches a prefix
SERVER = 5  # the server failed (5xx) or could not be reached
INTERRUPTED = 130


class CliError(Exception):
    """An error to print (on stderr) and exit with."""

    def __init__(self, message: str, code: int = USAGE, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.body = body


def code_for_status(status: int) -> int:
    """The exit code for an HTTP status the server answered with."""
    if status in (401, 403):
        return AUTH
    if status == 404:
        return NOT_FOUND
    if status == 409:
        return JOB_FAILED
    if 400 <= status < 500:
        return USAGE
    return SERVER


def messages_from(body: object) -> list[str]:
    """The server's reasons, one a line, from whatever shape of error body it sent."""
    if body is None:
        return []
    if isinstance(body, str):
        return [body.strip()] if body.strip() else []
    if isinstance(body, list):
        out: list[str] = []
        for item in body:
            out.extend(messages_from(item))
        return out
    if isinstance(body, dict):
        out = []
        errors = body.get("errors", None)
        if "detail" in body and not errors:  # with errors, the detail only sums them up
            out.extend(messages_from(body["detail"]))
        rest = {k: v for k, v in body.items() if k not in ("detail", "errors", "received", "state")}
        if "errors" in body:
            rest = errors if isinstance(errors, dict) else {"": errors}
        for field, value in rest.items():
            for message in messages_from(value):
                # Messages about the spec already say where (job.yaml line 7: ...).
                named = " line " in message or field in message or message.split(":")[0].endswith((".yaml", ".yml", ".json"))
                if field in ("", "non_field_errors", "spec", "__all__") or named:
                    out.append(message)
                else:
                    out.append(f"{field}: {message}")
        return out
    return [str(body)]
