"""The team's datasets: named data in immutable versions, uploaded in chunks or registered from a
bucket, with their pages, API and upload machinery (a job's code folder rides the same uploads).

Named catalog, not datasets: a top-level package `datasets` would shadow Hugging Face's, which
training scripts import and which a job's base Python could reach through our editable install."""
