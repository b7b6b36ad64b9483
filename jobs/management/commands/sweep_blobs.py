from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError

from jobs.sweep import describe, sweep


class Command(BaseCommand):
    help = "Free the blobs (uploaded and dataset files) that nothing refers to any more, once they are older than the grace period."

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")
        parser.add_argument(
            "--grace-hours",
            type=float,
            default=None,
            help="keep unreferenced blobs younger than this (default: E31_BLOB_SWEEP_GRACE_HOURS)",
        )

    def handle(self, *args, dry_run, grace_hours, **options):
        if grace_hours is not None and not grace_hours >= 0:  # not NaN either
            raise CommandError(f"--grace-hours must be a number of hours, 0 or more, not {grace_hours}")
        grace = None if grace_hours is None else timedelta(hours=grace_hours)
        self.stdout.write(describe(sweep(dry_run=dry_run, grace=grace)))
