# The datasets move to the catalog app (catalog/migrations/0001_initial.py says how): here they
# leave jobs' migration state, and jobs' foreign keys to a dataset version point at catalog's.
# State only: the tables, their rows and the columns of the foreign keys stay as they are.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('catalog', '0001_initial'),
        ('jobs', '0018_job_stop_requested'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.AlterField(
                    model_name='job',
                    name='train_version',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='catalog.datasetversion'),
                ),
                migrations.AlterField(
                    model_name='job',
                    name='heldout_version',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='catalog.datasetversion'),
                ),
                migrations.AlterField(
                    model_name='jobinput',
                    name='version',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='catalog.datasetversion'),
                ),
                # Those that point at the others go first.
                migrations.DeleteModel(name='DatasetUpload'),
                migrations.DeleteModel(name='DatasetFile'),
                migrations.DeleteModel(name='DatasetVersion'),
                migrations.DeleteModel(name='Dataset'),
            ],
        ),
    ]
