"""The team's jobs as the pages and the API look them up: another team's job or output file is a
404, as a missing one is (accounts.access.get_for_team). Datasets: catalog.access."""

from django.http import Http404

from accounts.access import get_for_team
from jobs.models import Job


def get_job(request, job_id):
    return get_for_team(Job.objects.all(), request.user, pk=job_id)


def get_artifact(job, name):
    artifact = job.artifacts.filter(name=name).first()
    if artifact is None:
        raise Http404("No such output file.")
    return artifact
