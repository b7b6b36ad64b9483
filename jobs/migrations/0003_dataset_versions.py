"""Datasets get immutable versions; jobs pin the versions they ran on."""

import uuid

import django.db.models.deletion
from django.db import migrations, models


def versions_for_existing_datasets(apps, schema_editor):
    Dataset = apps.get_model("jobs", "Dataset")
    DatasetVersion = apps.get_model("jobs", "DatasetVersion")
    DatasetFile = apps.get_model("jobs", "DatasetFile")
    Job = apps.get_model("jobs", "Job")
    for dataset in Dataset.objects.all():
        files = DatasetFile.objects.filter(dataset=dataset)
        version = DatasetVersion.objects.create(
            dataset=dataset,
            number=1,
            state="ready",
            sealed_at=dataset.created_at,
            file_count=files.count(),
            total_bytes=sum(f.size for f in files),
        )
        files.update(version=version)
        Job.objects.filter(train_dataset=dataset).update(train_version=version)
        Job.objects.filter(heldout_dataset=dataset).update(heldout_version=version)


class Migration(migrations.Migration):
    dependencies = [("jobs", "0002_wider_gpu_hour_ceiling")]

    operations = [
        migrations.CreateModel(
            name="DatasetVersion",
            fields=[
                ("id", models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ("number", models.PositiveIntegerField()),
                (
                    "state",
                    models.CharField(
                        choices=[("open", "Open"), ("scanning", "Scanning"), ("ready", "Ready"), ("failed", "Failed")],
                        default="open",
                        max_length=10,
                    ),
                ),
                ("error", models.TextField(blank=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("sealed_at", models.DateTimeField(blank=True, null=True)),
                ("file_count", models.PositiveIntegerField(default=0)),
                ("total_bytes", models.PositiveBigIntegerField(default=0)),
                ("claimed_at", models.DateTimeField(blank=True, null=True, help_text="when a worker took up its scan")),
                (
                    "dataset",
                    models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="versions", to="jobs.dataset"),
                ),
                (
                    "parent",
                    models.ForeignKey(
                        blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="+", to="jobs.datasetversion"
                    ),
                ),
            ],
            options={"ordering": ["dataset", "-number"]},
        ),
        migrations.AddConstraint(
            model_name="datasetversion",
            constraint=models.UniqueConstraint(fields=("dataset", "number"), name="dataset_version_number_unique"),
        ),
        migrations.AddField(
            model_name="dataset",
            name="source",
            field=models.CharField(choices=[("upload", "Uploaded"), ("s3", "S3 bucket")], default="upload", max_length=10),
        ),
        migrations.AddField(model_name="dataset", name="s3_bucket", field=models.CharField(blank=True, max_length=255)),
        migrations.AddField(model_name="dataset", name="s3_prefix", field=models.CharField(blank=True, max_length=1024)),
        migrations.AddField(model_name="dataset", name="s3_endpoint_url", field=models.CharField(blank=True, max_length=500)),
        migrations.AddField(model_name="dataset", name="s3_region", field=models.CharField(blank=True, max_length=64)),
        migrations.AddField(model_name="dataset", name="s3_credentials", field=models.TextField(blank=True)),
        migrations.AddField(
            model_name="datasetfile",
            name="version",
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.CASCADE, related_name="files", to="jobs.datasetversion"
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="train_version",
            field=models.ForeignKey(
                blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name="+", to="jobs.datasetversion"
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="heldout_version",
            field=models.ForeignKey(
                blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name="+", to="jobs.datasetversion"
            ),
        ),
        migrations.RunPython(versions_for_existing_datasets, migrations.RunPython.noop),
        migrations.RemoveConstraint(model_name="datasetfile", name="dataset_file_path_unique"),
        migrations.RemoveField(model_name="datasetfile", name="dataset"),
        migrations.RemoveField(model_name="job", name="train_dataset"),
        migrations.RemoveField(model_name="job", name="heldout_dataset"),
        migrations.AlterField(
            model_name="datasetfile",
            name="version",
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="files", to="jobs.datasetversion"),
        ),
        migrations.AlterField(model_name="datasetfile", name="key", field=models.CharField(max_length=1100)),
        migrations.AddConstraint(
            model_name="datasetfile",
            constraint=models.UniqueConstraint(fields=("version", "path"), name="dataset_version_file_path_unique"),
        ),
    ]
