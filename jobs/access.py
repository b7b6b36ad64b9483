"""The team's jobs as the pages and the API look them up: another team's job or output file is a
404, as a missing one is (accounts.access.get_for_team). Datasets: catalog.access."""

from django.core.exceptions import ValidationError
from django.db.models import UUIDField
from django.http import Http404

from accounts.access import get_for_team, require_team
from core.compiled import Param, Read
from jobs.models import Job

# Every job page and job endpoint reads its job first: its SQL made once (core.compiled).
TEAM_JOB = Read(lambda: Job.objects.filter(pk=Param("job", UUIDField()), team_id=Param("team", UUIDField()))[:1])


def get_job(request, job_id):
    """The team's job of that id (its team set on it), else accounts.access.get_for_team's
    answer: a 404, recorded where the job is another team's."""
    team = require_team(request.user)
    try:
        job = TEAM_JOB.first(job=job_id, team=team.pk, known={"team": team})
    except ValidationError:  # not an id: get_for_team says what it says of one
        job = None
    return job if job is not None else get_for_team(Job.objects.all(), request.user, pk=job_id)


def get_artifact(job, name):
    artifact = job.artifacts.filter(name=name).first()
    if artifact is None:
        raise Http404("No such output file.")
    return artifact
