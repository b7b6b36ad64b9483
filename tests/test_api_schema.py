"""The API's OpenAPI schema: it is served and generates cleanly, it describes every route, and
the API keeps to it when fuzzed (schemathesis, in process through the WSGI app): no input makes
a 5xx, and every answer has a status code, media type and body the schema documents."""

import time

import pytest
import schemathesis
from django.core.management import call_command
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.urls import reverse
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from rest_framework.authtoken.models import Token
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, status_code_conformance

from e31web import api_urls
from tests.api_world import make_world

EXAMPLES = 12  # per operation and mode: about 40 operations x 2 modes in well under a minute
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_the_schema_generates_without_warnings(tmp_path):
    call_command("spectacular", "--fail-on-warn", "--validate", "--file", str(tmp_path / "schema.yaml"))
    assert "/api/jobs/{job_id}/" in (tmp_path / "schema.yaml").read_text()


def test_the_schema_and_its_docs_are_served(client):
    schema = client.get(reverse("api:schema") + "?format=json").json()
    assert schema["openapi"].startswith("3.")
    # Every route of the API is in it, with its path parameters typed.
    documented = set(schema["paths"])
    for pattern in api_urls.urlpatterns:
        if pattern.name in ("schema", "docs"):
            continue
        path = "/api/" + str(pattern.pattern)
        for name, converter in pattern.pattern.converters.items():
            kind = type(converter).__name__.replace("Converter", "").lower()
            path = path.replace(f"<{kind}:{name}>", "{" + name + "}")
        assert path in documented, f"api:{pattern.name} ({path}) is not in the schema"
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path":
                    assert parameter["schema"].get("format") == "uuid" or parameter["schema"]["type"] in ("integer", "string"), (path, parameter)
            if method in ("post", "put"):
                assert "requestBody" in operation or operation["operationId"] in (
                    "job_cancel",
                    "job_compare",
                    "dataset_rescan",
                    "dataset_version_open",
                    "dataset_version_seal",
                ), f"{method.upper()} {path} does not describe its body"
    assert schema["components"]["schemas"]["Error"]["required"] == ["detail"]
    docs = client.get(reverse("api:docs"))
    assert docs.status_code == 200 and b"swagger-ui" in docs.content.lower()
    assert b"cdn" not in docs.content.lower()  # the Swagger UI comes from this server (sidecar), offline


@pytest.fixture
def wsgi_app():
    """Django's WSGI app, called in this thread and so in this test's transaction: like the test
    client, keep requests from closing the test's database connection."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield get_wsgi_application()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def test_the_api_keeps_to_its_schema_under_fuzzing(wsgi_app, alice, rate):
    world = make_world(alice, "fuzz")
    key = Token.objects.create(user=alice).key
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app)
    real = {k: str(v) for k, v in world.path_values().items()}
    headers = {"Authorization": f"Token {key}"}
    failures, calls, operations = [], 0, 0
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            seen = []

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode), use_real=st.booleans())
            def run(case, use_real):
                nonlocal calls
                if use_real and case.path_parameters:
                    # Half the cases name the team's real objects, so paths get past the 404s.
                    case.path_parameters = {**case.path_parameters, **{k: v for k, v in real.items() if k in case.path_parameters}}
                response = case.call(headers=headers)
                calls += 1
                try:
                    case.validate_response(response, checks=CHECKS, headers=headers)
                except (Exception, BaseExceptionGroup) as error:  # noqa: BLE001 - collected, reported together below
                    seen.append(f"{operation.label} [{mode.value}]: {error}")  # noqa: B023 - run() is called within its loop turn

            try:
                run()
            except Unsatisfiable:  # nothing of this operation can be made invalid in this mode
                pass
            failures.extend(seen[:2])
    elapsed = time.monotonic() - started
    print(f"schemathesis: {operations} operations, {calls} calls, {elapsed:.1f} s")
    assert operations >= 35
    assert not failures, "\n\n".join(failures)
