# The datasets move out of the jobs app into this one (issue 22), keeping every row: the models
# keep their tables (Meta.db_table: jobs_dataset, jobs_datasetversion, jobs_datasetfile,
# jobs_datasetupload), so this migration creates them in the migration state only, and
# jobs.0019_datasets_to_catalog takes them out of jobs' state and points jobs' foreign keys here.
# The tables were made by jobs' migrations up to 0018, which this one follows (a fresh database
# makes them there). Their content types follow them ('jobs' -> 'catalog'), so that permissions
# and the admin's history keep pointing at them.

import django.db.models.deletion
import uuid
from django.conf import settings
from django.db import migrations, models

MOVED = ["dataset", "datasetversion", "datasetfile", "datasetupload"]


def relabel_content_types(old, new):
    def relabel(apps, schema_editor):
        ContentType = apps.get_model("contenttypes", "ContentType")
        content_types = ContentType.objects.using(schema_editor.connection.alias)
        for model in MOVED:
            moving = content_types.filter(app_label=old, model=model).first()
            if moving is None:
                continue  # a fresh database: post_migrate makes the content types afterwards
            # One under the new label already was made by post_migrate after an earlier migrate
            # (then migrated back): it holds none of the rows' history. It goes, with its
            # permissions, and the one the history points at takes its label.
            content_types.filter(app_label=new, model=model).delete()
            moving.app_label = new
            moving.save(update_fields=["app_label"])

    return relabel


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('accounts', '0007_audit_refusals'),
        ('jobs', '0018_job_stop_requested'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        # For the content types: their permissions and the admin's log entries are in the state.
        ('contenttypes', '0002_remove_content_type_name'),
        ('auth', '0012_alter_user_first_name_max_length'),
        ('admin', '0003_logentry_add_action_flag_choices'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name='Dataset',
                    fields=[
                        ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                        ('name', models.CharField(max_length=200)),
                        ('description', models.TextField(blank=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('source', models.CharField(choices=[('upload', 'Uploaded'), ('s3', 'S3 bucket')], default='upload', max_length=10)),
                        ('s3_bucket', models.CharField(blank=True, max_length=255)),
                        ('s3_prefix', models.CharField(blank=True, max_length=1024)),
                        ('s3_endpoint_url', models.CharField(blank=True, max_length=500)),
                        ('s3_region', models.CharField(blank=True, max_length=64)),
                        ('s3_credentials', models.TextField(blank=True)),
                        ('team', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='datasets', to='accounts.team')),
                    ],
                    options={
                        'db_table': 'jobs_dataset',
                        'ordering': ['name'],
                    },
                ),
                migrations.CreateModel(
                    name='DatasetVersion',
                    fields=[
                        ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                        ('number', models.PositiveIntegerField()),
                        ('state', models.CharField(choices=[('open', 'Open'), ('scanning', 'Scanning'), ('ready', 'Ready'), ('failed', 'Failed')], default='open', max_length=10)),
                        ('error', models.TextField(blank=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('sealed_at', models.DateTimeField(blank=True, null=True)),
                        ('file_count', models.PositiveIntegerField(default=0)),
                        ('total_bytes', models.PositiveBigIntegerField(default=0)),
                        ('claimed_at', models.DateTimeField(blank=True, help_text='when a worker took up its scan', null=True)),
                        ('dataset', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='versions', to='catalog.dataset')),
                        ('parent', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='catalog.datasetversion')),
                    ],
                    options={
                        'db_table': 'jobs_datasetversion',
                        'ordering': ['dataset', '-number'],
                    },
                ),
                migrations.CreateModel(
                    name='DatasetUpload',
                    fields=[
                        ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                        ('path', models.CharField(help_text='in a version, as catalog.datasets.clean_path makes it; in a folder, as sent', max_length=1024)),
                        ('size', models.PositiveBigIntegerField()),
                        ('sha256', models.CharField(blank=True, help_text="the client's digest to check, then the file's", max_length=64)),
                        ('chunk_size', models.PositiveIntegerField()),
                        ('received', models.PositiveBigIntegerField(default=0)),
                        ('key', models.CharField(help_text='the incoming object in storage, until it becomes a blob', max_length=200)),
                        ('multipart_id', models.CharField(blank=True, help_text="the storage's multipart upload id", max_length=1024)),
                        ('parts', models.JSONField(blank=True, default=list, help_text='[[part number, etag], ...] in order')),
                        ('state', models.CharField(choices=[('open', 'Open'), ('completing', 'Completing'), ('complete', 'Complete'), ('failed', 'Failed'), ('aborted', 'Aborted')], default='open', max_length=10)),
                        ('claimed_at', models.DateTimeField(blank=True, help_text='when a worker took up its completion', null=True)),
                        ('error', models.TextField(blank=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('updated_at', models.DateTimeField(auto_now=True)),
                        ('created_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                        ('folder', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='files', to='jobs.folderupload')),
                        ('version', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='uploads', to='catalog.datasetversion')),
                    ],
                    options={
                        'db_table': 'jobs_datasetupload',
                        'ordering': ['created_at'],
                    },
                ),
                migrations.CreateModel(
                    name='DatasetFile',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('path', models.CharField(max_length=500)),
                        ('key', models.CharField(max_length=1100)),
                        ('size', models.PositiveBigIntegerField()),
                        ('sha256', models.CharField(max_length=64)),
                        ('version', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='files', to='catalog.datasetversion')),
                    ],
                    options={
                        'db_table': 'jobs_datasetfile',
                        'ordering': ['path'],
                    },
                ),
                migrations.AddConstraint(
                    model_name='dataset',
                    constraint=models.UniqueConstraint(fields=('team', 'name'), name='dataset_name_unique_in_team'),
                ),
                migrations.AddConstraint(
                    model_name='datasetversion',
                    constraint=models.UniqueConstraint(fields=('dataset', 'number'), name='dataset_version_number_unique'),
                ),
                migrations.AddIndex(
                    model_name='datasetupload',
                    index=models.Index(fields=['state', 'updated_at'], name='jobs_datase_state_e8838c_idx'),
                ),
                migrations.AddConstraint(
                    model_name='datasetupload',
                    constraint=models.CheckConstraint(condition=models.Q(models.Q(('folder__isnull', True), ('version__isnull', False)), models.Q(('folder__isnull', False), ('version__isnull', True)), _connector='OR'), name='dataset_upload_into_a_version_or_a_folder'),
                ),
                migrations.AddConstraint(
                    model_name='datasetfile',
                    constraint=models.UniqueConstraint(fields=('version', 'path'), name='dataset_version_file_path_unique'),
                ),
            ],
        ),
        migrations.RunPython(relabel_content_types("jobs", "catalog"), relabel_content_types("catalog", "jobs")),
    ]
