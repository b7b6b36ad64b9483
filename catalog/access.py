"""The team's datasets as the pages and the API look them up: another team's dataset, version or
upload is a 404, as a missing one is (accounts.access.get_for_team)."""

from django.http import Http404

from accounts.access import get_for_team
from catalog.models import Dataset, DatasetUpload

# What a member who is not the team's owner is told when they would change a dataset.
OWNERS_ONLY = {
    "delete": "Only the team's owner can delete a dataset.",
    "credentials": "Only the team's owner can change a bucket's credentials.",
}


def get_dataset(request, dataset_id):
    return get_for_team(Dataset.objects.all(), request.user, pk=dataset_id)


def get_version(dataset, number):
    version = dataset.versions.select_related("dataset", "parent").filter(number=number).first()
    if version is None:
        raise Http404(f"{dataset.name} has no version {number}.")
    return version


def get_upload(request, upload_id):
    # A folder's file (jobs/folder_uploads.py) is no dataset's upload: not found here.
    uploads = DatasetUpload.objects.filter(version__isnull=False).select_related("version__dataset")
    return get_for_team(uploads, request.user, "version__dataset__team", pk=upload_id)
