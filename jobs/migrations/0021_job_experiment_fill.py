# The jobs made before experiments: each in its name's, a sweep's trials in their sweep's.

from django.db import migrations, models


def fill(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    Job.objects.filter(experiment="").update(experiment=models.F("name"))
    Trial = apps.get_model("sweeps", "Trial")
    for job_id, sweep_name in Trial.objects.values_list("job_id", "sweep__name"):
        Job.objects.filter(pk=job_id).update(experiment=sweep_name)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0020_job_experiment"),
        ("sweeps", "0001_initial"),
    ]

    operations = [migrations.RunPython(fill, migrations.RunPython.noop)]
