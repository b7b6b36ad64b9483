# The index of a job's metric points (jobs.models.JobEvent). The event table is the largest:
# on PostgreSQL the index is built CONCURRENTLY, so that runners go on writing log lines while it
# builds (a plain CREATE INDEX holds back every write to the table until it is done).

from django.db import migrations, models


class AddIndexConcurrentlyOnPostgres(migrations.AddIndex):
    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.add_index(model, self.index, concurrently=True)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.remove_index(model, self.index, concurrently=True)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("jobs", "0023_job_event_rare_kinds"),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name="jobevent",
            index=models.Index(condition=models.Q(("kind", "metric")), fields=["job", "seq"], name="job_event_metrics"),
        ),
    ]
