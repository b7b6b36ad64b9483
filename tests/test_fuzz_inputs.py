"""Hostile input, generated: the spec parser and the dataset upload paths answer with their own
errors (a 4xx through the API), never a crash."""

import json

import pytest
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catalog import datasets
from jobs import specfile

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
SPEC_WORDS = st.sampled_from(["name", "kind", "work", "data", "request", "output", "gpus", "code", "early_stop", "train_files", "config"])
SPECISH = st.dictionaries(SPEC_WORDS, JSONISH, max_size=6)


@pytest.mark.nodb
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400) | st.binary(max_size=200))
def test_the_spec_parser_takes_any_text(text):
    try:
        spec = specfile.read(text, "fuzz.yaml")
    except specfile.SpecFileError as error:
        assert str(error).startswith("fuzz.yaml")
    else:
        json.dumps(spec.fields)  # what it read is plain data


@pytest.mark.nodb
@settings(max_examples=300, deadline=None)
@given(SPECISH | JSONISH)
def test_the_spec_parser_takes_any_structure(document):
    try:
        specfile.read(json.dumps(document), None)
    except specfile.SpecFileError:
        pass


@pytest.mark.nodb
@settings(max_examples=500, deadline=None)
@given(st.text(max_size=80) | st.none() | st.integers() | st.lists(st.text(max_size=3), max_size=2))
def test_a_dataset_path_is_clean_or_refused(path):
    try:
        clean = datasets.clean_path(path)
    except datasets.DatasetError:
        return
    parts = clean.split("/")
    assert ".." not in parts and "" not in parts and not clean.startswith("/")
    clean.encode("utf-8")


@pytest.mark.nodb
@pytest.mark.parametrize("path", [7, ["a"], "a/\ud800.csv", "x/../y", "a\x00b"])
def test_hostile_dataset_paths_found_by_fuzzing_are_refused(path):
    with pytest.raises(datasets.DatasetError):
        datasets.clean_path(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(spec=SPECISH | st.text(max_size=200), name=st.text(max_size=20))
def test_the_jobs_api_answers_any_spec_with_a_4xx(client, token, rate, spec, name):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    body = {"spec": spec if isinstance(spec, str) else json.dumps(spec), "spec_name": name}
    for url in (reverse("api:jobs"), reverse("api:estimate")):
        response = client.post(url, body)
        assert response.status_code < 500, (url, body, response.content[:300])
        if response.status_code >= 400:
            assert response.json()["detail"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=JSONISH, size=JSONISH, sha256=JSONISH)
def test_the_upload_api_answers_any_start_with_a_4xx(client, token, dataset, path, size, sha256):
    from catalog.datasets import open_version

    version, _ = open_version(dataset)
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    url = reverse("api:dataset-uploads", args=[dataset.pk, version.number])
    response = client.post(url, {"path": path, "size": size, "sha256": sha256}, content_type="application/json")
    assert response.status_code < 500, ({"path": path, "size": size, "sha256": sha256}, response.content[:300])
