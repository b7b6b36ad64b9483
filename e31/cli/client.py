"""The HTTP side of the client: one httpx.Client with the token, errors turned into exit codes."""

import re
from collections.abc import Container
from typing import Any, Self

import httpx

from e31.cli.errors import NOT_FOUND, SERVER, USAGE, CliError, code_for_status, messages_from

FULL_ID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
USER_AGENT = "e31-cli/0.1"
DEFAULT_TRANSPORT: httpx.BaseTransport | None = None  # tests put an httpx.MockTransport here


class Client:
    def __init__(self, server: str, token: str | None = None, transport: httpx.BaseTransport | None = None, timeout: float = 60.0) -> None:
        self.server = server.rstrip("/")
        self.token = token
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Token {token}"
        # Redirects are followed (artifacts may be served by storage); httpx drops the
        # Authorization header when a redirect leaves the server.
        self.http = httpx.Client(
            base_url=self.server,
            headers=headers,
            transport=transport or DEFAULT_TRANSPORT,
            follow_redirects=True,
            timeout=httpx.Timeout(timeout, connect=15.0),
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Requests -----------------------------------------------------------------------------

    def request(self, method: str, path: str, ok: Container[int] | None = None, **kwargs: Any) -> httpx.Response:
        """The response, or a CliError carrying the exit code for what went wrong."""
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise CliError(f"Could not reach {self.server}: {error_text(error)}", SERVER) from None
        check(response, ok)
        return response

    def json(self, method: str, path: str, ok: Container[int] | None = None, **kwargs: Any) -> Any:
        response = self.request(method, path, ok=ok, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise CliError(f"The server sent something that is not JSON for {method} {path}.", SERVER) from None

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.json("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.json("POST", path, **kwargs)

    def pages(self, path: str, params: dict[str, Any] | None = None, limit: int | None = None) -> list[Any]:
        """Items of a list endpoint: a plain list, or pages {"results", "next"} followed up to
        limit items (or {"<name>": [...]})."""
        items: list[Any] = []
        url: str | None = path
        query = params
        while url:
            body = self.get(url, params=query)
            query = None  # the next link carries the query
            if isinstance(body, list):
                items.extend(body)
                url = None
            elif isinstance(body, dict) and isinstance(body.get("results"), list):
                items.extend(body["results"])
                url = body.get("next")
            elif isinstance(body, dict):
                lists = [v for v in body.values() if isinstance(v, list)]
                items.extend(lists[0] if lists else [])
                url = None
            else:
                url = None
            if limit is not None and len(items) >= limit:
                return items[:limit]
        return items

    # Jobs ---------------------------------------------------------------------------------

    def resolve_job(self, ref: str) -> str:
        """A job's full id from its id or a unique prefix of it."""
        ref = ref.strip().lower()
        if FULL_ID.match(ref):
            return ref
        if not re.fullmatch(r"[0-9a-f-]{1,36}", ref):
            raise CliError(f"{ref!r} is not a job id (or the start of one).", USAGE)
        found = [j for j in self.pages("/api/jobs/", params={"id_prefix": ref}, limit=200) if str(j.get("id", "")).startswith(ref)]
        if not found:
            raise CliError(f"No job's id starts with {ref}.", NOT_FOUND)
        if len(found) > 1:
            names = ", ".join(f"{j['id'][:8]} ({j.get('name', '')})" for j in found[:10])
            raise CliError(f"{len(found)} jobs' ids start with {ref}: {names}. Give more of the id.", USAGE)
        return found[0]["id"]

    def job(self, job_id: str) -> Any:
        return self.get(f"/api/jobs/{job_id}/")

    def ws_url(self, path: str) -> str:
        if self.server.startswith("https://"):
            return "wss://" + self.server[len("https://") :] + path
        if self.server.startswith("http://"):
            return "ws://" + self.server[len("http://") :] + path
        return self.server + path


def check(response: httpx.Response, ok: Container[int] | None = None) -> None:
    """Raise a CliError for a response that is not a success (or not one of ok)."""
    if ok is not None and response.status_code in ok:
        return
    if ok is None and response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = response.text[:2000] if response.headers.get("content-type", "").startswith("text/plain") else None
    lines = messages_from(body)
    if not lines:
        lines = [f"{response.request.method} {response.request.url.path} answered {response.status_code} {response.reason_phrase}."]
    raise CliError("\n".join(lines), code_for_status(response.status_code), status=response.status_code, body=body)


def error_text(error: BaseException) -> str:
    return str(error) or type(error).__name__
