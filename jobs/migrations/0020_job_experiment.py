# Every job belongs to an experiment: by default its name (Job.save), a sweep's trials the sweep's.
# The jobs made before are given theirs by the next migration: not in this one, where PostgreSQL
# creates the column's index at the end, and cannot while the updates' deferred foreign-key
# checks are pending ("cannot CREATE INDEX ... because it has pending trigger events").

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0019_datasets_to_catalog"),
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
    ]
