import django.db.models.deletion
from django.db import migrations, models


def fill_labels(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for role in ("train", "heldout"):
        jobs = Job.objects.filter(**{f"{role}_version__isnull": False}).select_related(f"{role}_version__dataset")
        for job in jobs.iterator():
            version = getattr(job, f"{role}_version")
            Job.objects.filter(pk=job.pk).update(**{f"{role}_label": f"{version.dataset.name}@{version.number}"})


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0010_utilization"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="train_label",
            field=models.CharField(blank=True, help_text="the training dataset version, as NAME@N", max_length=300),
        ),
        migrations.AddField(
            model_name="job",
            name="heldout_label",
            field=models.CharField(blank=True, help_text="the held-out dataset version, as NAME@N", max_length=300),
        ),
        migrations.AlterField(
            model_name="job",
            name="train_version",
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="+", to="jobs.datasetversion"),
        ),
        migrations.AlterField(
            model_name="job",
            name="heldout_version",
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="+", to="jobs.datasetversion"),
        ),
        migrations.AddField(
            model_name="datasetupload",
            name="claimed_at",
            field=models.DateTimeField(blank=True, help_text="when a worker took up its completion", null=True),
        ),
        migrations.RunPython(fill_labels, migrations.RunPython.noop),
    ]
