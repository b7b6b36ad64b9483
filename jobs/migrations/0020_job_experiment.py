# Every job belongs to an experiment: by default its name (Job.save), a sweep's trials the sweep's.
# The jobs made before keep theirs as their name, and a sweep's trials take their sweep's.

from django.db import migrations, models


def fill(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    Job.objects.filter(experiment="").update(experiment=models.F("name"))
    Trial = apps.get_model("sweeps", "Trial")
    for job_id, sweep_name in Trial.objects.values_list("job_id", "sweep__name"):
        Job.objects.filter(pk=job_id).update(experiment=sweep_name)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0019_datasets_to_catalog"),
        ("sweeps", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="experiment",
            field=models.CharField(
                blank=True,
                db_index=True,
                help_text="the experiment it belongs to: by default its name; a sweep's trials, the sweep's; a copy, its source's",
                max_length=200,
            ),
        ),
        migrations.RunPython(fill, migrations.RunPython.noop),
    ]
