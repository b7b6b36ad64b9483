import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import connection
from django.utils import timezone

from billing import budget_service
from catalog import datasets
from core.sessions import SessionStore
from core.signals import stop_on_signals
from jobs import folder_uploads, sweep
from jobs.models import Upload
from notifications import delivery
from scheduler import allocations, engine, predictions, services
from scheduler.executors.configured import get_executor
from sweeps import services as sweep_steps
from tracking import worker as tracking

log = logging.getLogger("scheduler")
HOUSEKEEPING_SECONDS = 600
# Sweeps are advanced at most this often (every cycle at the default interval): a look reads only
# the metric events the running trials logged since the last one, and rebuilds a trial's search
# only when it logged; a pruned trial is told to stop within a cycle of the point that condemned it.
SWEEP_SECONDS = 0.5
UNCLAIMED_UPLOADS_KEPT = timedelta(days=2)  # a refused form's files wait this long for the user to come back
COMPLETION_WORKERS = 2  # dataset uploads completed at once


class Command(BaseCommand):
    help = "Place queued jobs on the free devices of live runners, and declare silent runners lost."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=settings.E31_SCHEDULER_INTERVAL_SECONDS)
        parser.add_argument("--once", action="store_true", help="run one cycle and exit")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shutdown = False
        self.next_housekeeping = 0.0
        self.next_prediction = 0.0
        self.next_sweep = 0.0
        self.next_engine = 0.0
        self.executor = get_executor()  # None: our own runners, which register themselves
        self.last_failure_at = None  # when a cycle last failed (the database away, say)
        # Scans of registered buckets read every object: they run beside the cycle, not in it
        # (and so does the blob sweep). The pools start their threads only when given work.
        self.scans = ThreadPoolExecutor(max_workers=2, thread_name_prefix="scan")
        # So do completions of large dataset uploads (a join and a read of the whole file), each
        # claimed only when a worker is free to start it: a claim never waits in a queue.
        self.completions = ThreadPoolExecutor(max_workers=COMPLETION_WORKERS, thread_name_prefix="complete")
        self.completing = set()

    def handle(self, *args, interval, once, **options):
        if once:
            self.handle_one_cycle()
            self.scans.shutdown(wait=True)
            self.completions.shutdown(wait=True)
            return
        self.stdout.write(f"scheduler: placing queued jobs every {interval:g} s")
        # Emails and webhooks go out from a thread of their own (its own database connection):
        # a receiver that hangs or fails holds up that thread only, never a cycle.
        self.notify_stop = threading.Event()
        delivery.start_thread(self.notify_stop)
        # So do the jobs' runs in the teams' MLflow trackers: a tracker down or slow holds up
        # that thread only, and its deliveries wait in their outbox.
        tracking.start_thread(self.notify_stop)
        with stop_on_signals(self.stop):
            while not self.shutdown:
                self.handle_one_cycle()
                self.sleep(interval)
        self.notify_stop.set()
        self.scans.shutdown(wait=False, cancel_futures=True)
        self.completions.shutdown(wait=False, cancel_futures=True)
        self.stdout.write("scheduler: stopped")

    @staticmethod
    def scan(version):
        try:
            datasets.scan(version)
        finally:
            connection.close()

    @staticmethod
    def sweep_blobs():
        try:
            sweep.sweep()
        except Exception:  # storage trouble: logged; it runs again at the next housekeeping
            log.exception("blob sweep failed")
        finally:
            connection.close()

    @staticmethod
    def complete(upload):
        try:
            datasets.finish_completion(upload)
        except datasets.DatasetError:
            pass  # failed, with the reason, which its client reads
        except Exception:
            log.exception("completing the upload of %s", upload)
        finally:
            connection.close()

    def stop(self):
        self.shutdown = True

    def sleep(self, seconds):
        deadline = time.monotonic() + seconds
        while not self.shutdown and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def handle_one_cycle(self):
        try:
            allocations.expire_lost_nodes(last_failure_at=self.last_failure_at)
            for version in datasets.claim_scans(limit=2):
                self.scans.submit(self.scan, version)
            self.completing = {future for future in self.completing if not future.done()}
            for upload in datasets.claim_completions(limit=COMPLETION_WORKERS - len(self.completing)):
                self.completing.add(self.completions.submit(self.complete, upload))
            if time.monotonic() >= self.next_sweep:
                self.next_sweep = time.monotonic() + SWEEP_SECONDS
                for trial in sweep_steps.advance_all():
                    log.info("sweep %s: queued trial %d (job %s)", trial.sweep_id, trial.number, trial.job_id)
            services.line_up()
            for allocation in services.schedule():
                log.info("placed job %s: %s", allocation.job_id, allocation.describe())
            if self.executor is not None and time.monotonic() >= self.next_engine:
                self.next_engine = time.monotonic() + settings.E31_ENGINE_SECONDS
                try:
                    engine.cycle(self.executor)
                except Exception:  # noqa: BLE001 - the engine away: its nodes go silent, the rest goes on
                    log.exception("reading the cluster engine failed")
            if time.monotonic() >= self.next_prediction:
                self.next_prediction = time.monotonic() + settings.E31_PREDICT_SECONDS
                predictions.update_predictions()
                budget_service.notify_budgets()
            if time.monotonic() >= self.next_housekeeping:
                self.next_housekeeping = time.monotonic() + HOUSEKEEPING_SECONDS
                purged = Upload.purge_unclaimed(timezone.now() - UNCLAIMED_UPLOADS_KEPT)
                if purged:
                    log.info("deleted %d uploads kept for refused forms and never claimed", purged)
                abandoned = folder_uploads.purge_stale_uploads(timezone.now() - UNCLAIMED_UPLOADS_KEPT)
                if abandoned:
                    log.info("gave up %d dataset uploads no chunk reached for two days", abandoned)
                # Browsers' sessions past their expiry (Django keeps them until told: signed out
                # or expired, each stayed a row for good).
                SessionStore.clear_expired()
                # After the purges, so the blobs of the rows they removed go too (once old).
                # Beside the cycle, like scans: on a large store the listing takes a while.
                self.scans.submit(self.sweep_blobs)
        except Exception:
            # A bad cycle (a database hiccup) must not end the loop; the next cycle retries
            # on a fresh connection.
            log.exception("scheduling cycle failed")
            self.last_failure_at = timezone.now()
            connection.close()
