"""Device utilization: windows and their merging, summaries, right-size hints and idle detection
(pure, on recorded samples), then the runner sampling real jobs on the CPU and stopping an idle one."""

import json
import statistics
from decimal import Decimal

import pytest

from jobs.utilization import (
    IdleWatch,
    Reading,
    Recorder,
    Summary,
    chart,
    right_size,
    stored_bytes,
    suggested_devices,
    summarize,
)

GIB = 1024**3

# Recorded on an 8-GPU node (NVML, every 2 s): a data-parallel run that only kept two of its eight
# GPUs busy. Each row: the utilization of GPUs 0-7 (percent), then the memory of each (GiB).
RECORDED_8_GPUS = [
    ([97, 94, 0, 0, 1, 0, 0, 0], [10.8, 10.6, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]),
    ([99, 96, 0, 0, 0, 0, 2, 0], [10.9, 10.7, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]),
    ([88, 91, 0, 0, 0, 0, 0, 0], [11.2, 10.7, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]),
    ([100, 99, 0, 1, 0, 0, 0, 0], [11.0, 10.8, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]),
    ([93, 95, 0, 0, 0, 0, 0, 0], [10.9, 10.8, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]),
    ([96, 97, 0, 0, 0, 0, 0, 0], [10.9, 10.8, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]),
]
H100 = 80 * GIB
SERIES_8 = [{"name": f"gpu{i}", "kind": "gpu", "memory_total": H100} for i in range(8)]


def readings(row):
    utils, memories = row
    return [Reading(float(u), int(m * GIB)) for u, m in zip(utils, memories)]


def record(rows, every=2.0, width=30.0, limit=240, repeat=1):
    recorder = Recorder(every=every, width=width, limit=limit)
    t = 0.0
    for _ in range(repeat):
        for row in rows:
            recorder.add(t, readings(row))
            t += every
    return recorder


class TestWindows:
    pytestmark = pytest.mark.nodb

    def test_two_second_samples_become_thirty_second_windows_of_mean_and_peak(self):
        recorder = Recorder(every=2.0, width=30.0)
        closed = [recorder.add(t * 2.0, [Reading(float(t), t * 1024 * 1024)]) for t in range(30)]
        assert closed.count(True) == 1  # the first window closed at t=30 s, the second is open
        first, second = recorder.snapshot()
        assert first == [0.0, 30.0, [[7.0, 14.0, 7, 14]]]  # mean % and peak %, mean MiB and peak MiB
        assert second == [30.0, 30.0, [[22.0, 29.0, 22, 29]]]
        assert recorder.windows == [first]  # the open window is in the snapshot only

    def test_a_long_run_is_merged_into_coarser_windows_and_stays_a_few_kb_per_hour(self):
        hours = 10
        recorder = Recorder(every=2.0, width=30.0, limit=240)
        for i in range(hours * 1800):
            recorder.add(i * 2.0, [Reading(50.0 + (i % 2) * 10, GIB)])
        windows = recorder.snapshot()
        assert len(windows) <= 240 and recorder.width == 240.0  # 30 s doubled three times
        assert all(w[1] <= recorder.width for w in windows)
        assert sum(w[1] for w in windows) == pytest.approx(hours * 3600)
        summary = summarize([([{"name": "gpu0", "memory_total": H100}], windows)])
        assert summary.series[0].mean == pytest.approx(55.0) and summary.series[0].peak == 60.0
        assert stored_bytes(windows) / hours < 4096
        one_hour = Recorder(every=2.0, width=30.0, limit=240)
        for i in range(1800):
            one_hour.add(i * 2.0, [Reading(55.0, GIB)])
        assert len(one_hour.snapshot()) == 120 and stored_bytes(one_hour.snapshot()) < 4096

    def test_a_gap_in_the_samples_is_not_merged_over(self):
        recorder = Recorder(every=1.0, width=10.0, limit=2)
        for t in [0, 1, 2, 12, 13, 50, 51, 80]:
            recorder.add(float(t), [Reading(10.0 * t, 0)])
        assert recorder.width == 20.0  # three windows closed: merged two by two
        windows = recorder.snapshot()
        assert [(w[0], w[1]) for w in windows] == [(0, 5), (50, 2), (80, 1)]
        assert windows[0][2] == [[56, 130, 0, 0]]  # 0-10 s and 10-20 s as one: (0+10+20+120+130) / 5


class TestHints:
    pytestmark = pytest.mark.nodb

    def summary(self):
        recorder = record(RECORDED_8_GPUS, repeat=50)  # ten minutes of it
        return summarize([(SERIES_8, recorder.snapshot())])

    def test_the_summary_has_mean_and_peak_per_device(self):
        summary = self.summary()
        assert [s.name for s in summary.series] == [f"gpu{i}" for i in range(8)]
        gpu0 = summary.series[0]
        assert gpu0.mean == pytest.approx(95.5, abs=0.1) and gpu0.peak == 100.0
        assert gpu0.memory_peak == pytest.approx(11.2 * GIB, rel=0.001) and gpu0.memory_total == H100
        assert summary.busy == pytest.approx(1.9, abs=0.02)
        assert summary.seconds == pytest.approx(600)
        assert Summary.from_data(json.loads(json.dumps(summary.as_data()))) == summary

    def test_an_8_gpu_job_that_kept_2_busy_is_told_what_a_2_gpu_request_would_have_saved(self):
        hints = right_size(self.summary(), devices=8, held_seconds=7200, rate=Decimal("2.40"), currency="USD")
        devices, memory = hints
        assert devices.kind == "devices" and devices.suggested == 2
        assert devices.saving == Decimal("28.80")  # 6 GPUs x 2 h x 2.40
        assert devices.text == "this 8-GPU job kept 1.9 GPUs' worth busy: a 2-GPU request would have cost about USD 28.80 less"
        assert memory.text == "peak memory 11 GB of 80 GB"

    def test_a_job_that_used_what_it_held_gets_no_devices_hint(self):
        busy = [([90, 95, 88, 97], [30, 31, 30, 29])] * 20
        summary = summarize([(SERIES_8[:4], record(busy).snapshot())])
        hints = right_size(summary, devices=4, held_seconds=3600, rate=Decimal("2.40"))
        assert [h.kind for h in hints] == ["memory"] and hints[0].text == "peak memory 31 GB of 80 GB"

    def test_a_one_device_job_mostly_waiting_is_told_so(self):
        summary = summarize([(SERIES_8[:1], record([([12], [3.5])] * 20).snapshot())])
        kinds = [h.kind for h in right_size(summary, devices=1, held_seconds=60)]
        assert kinds == ["low", "memory"]

    def test_a_cpu_job_s_cores_busy_count_as_devices_worth(self):
        series = [{"name": "cpu", "kind": "cpu", "memory_total": None}]
        summary = summarize([(series, record([([101], [0.2])] * 20).snapshot())])
        [hint] = right_size(summary, devices=4, held_seconds=1800, rate=Decimal("1.00"), unit="slot")
        assert hint.text.startswith("this 4-slot job kept 1.0 slots' worth busy: a 1-slot request")
        assert hint.saving == Decimal("1.50")

    def test_the_suggested_request_rounds_up_past_a_little_slack(self):
        assert [suggested_devices(busy, 8) for busy in (0.0, 0.5, 1.05, 1.2, 7.9, 9.0)] == [1, 1, 1, 2, 8, 8]

    def test_runs_of_a_restarted_job_are_one_series_weighted_by_time(self):
        series = [{"name": "gpu0", "memory_total": H100}]
        first = record([([100], [1])] * 30).snapshot()  # 60 s at 100%
        second = record([([0], [2])] * 15).snapshot()  # 30 s at 0%
        summary = summarize([(series, first), (series, second)])
        assert summary.series[0].mean == pytest.approx(66.7, abs=0.1) and summary.seconds == 90
        assert summarize([]) is None and right_size(None, devices=1, held_seconds=1) == []

    def test_the_chart_spans_the_held_time(self):
        drawn = chart([(0.0, SERIES_8[:2], record(RECORDED_8_GPUS, repeat=20).snapshot())], width=100, height=50)
        assert drawn["top"] == 100 and [line["name"] for line in drawn["lines"]] == ["gpu0", "gpu1"]
        xs = [float(p.split(",")[0]) for p in drawn["lines"][0]["points"].split()]
        assert 0 < xs[0] < xs[-1] < 100


class TestIdle:
    pytestmark = pytest.mark.nodb

    def test_idle_since_the_first_sample_with_every_device_below_the_threshold(self):
        watch = IdleWatch(threshold=5.0)
        assert watch.add(0, [Reading(50.0, 0), Reading(1.0, 0)]) is None
        assert watch.add(2, [Reading(4.0, 0), Reading(1.0, 0)]) == 2
        assert watch.add(4, [Reading(0.0, 0), Reading(0.0, 0)]) == 2 and watch.idle_for(10) == 8
        assert watch.add(6, [Reading(0.0, 0), Reading(6.0, 0)]) is None and watch.idle_for(10) == 0


class TestReading:
    pytestmark = pytest.mark.nodb

    class FakeNvml:
        """NVML as pynvml answers, for a node whose GPU 3 is busy."""

        def nvmlDeviceGetHandleByIndex(self, index):
            return index

        def nvmlDeviceGetMemoryInfo(self, handle):
            from types import SimpleNamespace

            return SimpleNamespace(total=80 * GIB, used=(handle + 1) * GIB)

        def nvmlDeviceGetUtilizationRates(self, handle):
            from types import SimpleNamespace

            return SimpleNamespace(gpu=90 if handle == 3 else 0)

    def test_a_job_s_own_gpus_are_read_through_nvml(self):
        from agent.sampling import GpuSampler

        sampler = GpuSampler(self.FakeNvml(), [3, 5], prefix="node1:")
        assert sampler.series == [
            {"name": "node1:gpu0", "kind": "gpu", "memory_total": 80 * GIB},
            {"name": "node1:gpu1", "kind": "gpu", "memory_total": 80 * GIB},
        ]
        assert sampler.read() == [Reading(90.0, 4 * GIB), Reading(0.0, 6 * GIB)]

    def test_without_an_nvidia_driver_the_process_tree_is_read(self, monkeypatch):
        import os
        import time

        from agent import sampling

        monkeypatch.setattr(sampling, "_nvml", False)  # as after a failed nvmlInit()
        sampler = sampling.sampler_for(pid=os.getpid(), devices=[0], device_type="H100")
        assert isinstance(sampler, sampling.ProcessTreeSampler) and sampler.series[0]["name"] == "cpu"
        assert sampler.read() is None  # the first reading is where counting starts
        started = time.process_time()
        while time.process_time() - started < 0.05:  # some CPU time to count
            pass
        [reading] = sampler.read()
        assert reading.util > 0 and reading.memory > 0


# The runner, with real job processes --------------------------------------------------------------

BUSY_ONE_CORE = b"""
import time
start = time.monotonic()
while time.monotonic() < start + 3:
    pass
print(f"my share of a core: {time.process_time() / (time.monotonic() - start):.2f}")
"""

# Idle until told to stop, then checkpoints (the way a script without torch would) and exits.
IDLE_UNTIL_STOPPED = b"""
import os, time, pathlib
from e31 import should_stop
step = 0
print("waiting", flush=True)
while not should_stop() and step < 600:
    step += 1
    time.sleep(0.05)
folder = pathlib.Path(os.environ["E31_CHECKPOINT_DIR"])
(folder / ".ckpt.tmp").write_bytes(b"weights at %d" % step)
os.replace(folder / ".ckpt.tmp", folder / f"ckpt-{step}.bin")
print("stopping at", step, flush=True)
"""


@pytest.fixture
def emitted(monkeypatch):
    from notifications import events

    calls = []
    monkeypatch.setattr(events, "emit", lambda kind, **kw: calls.append((kind, kw)))
    return calls


@pytest.fixture
def runner(db, settings, tmp_path):
    from agent.runner import Runner

    settings.E31_STOP_GRACE_SECONDS = 2.0
    settings.E31_UTIL_SAMPLE_SECONDS = 0.25
    settings.E31_UTIL_WINDOW_SECONDS = 1.0
    settings.E31_UTIL_IDLE_MINUTE_SECONDS = 0.5  # an idle "minute" lasts half a second here
    runner = Runner(name="util-node", devices=2, work_dir=tmp_path / "runs", device_type="cpu")
    runner.register()
    yield runner
    runner.stop_all()


@pytest.mark.runs_jobs
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
class TestSampling:
    def test_a_job_busy_on_one_core_reads_near_one_core(self, runner, alice, rate):
        from jobs.models import Utilization
        from tests.conftest import make_job
        from tests.test_runner import log_lines, run_job

        job = run_job(runner, make_job(alice, script=BUSY_ONE_CORE, gpus=1))
        assert job.state == "succeeded"
        run = Utilization.objects.get(job=job)
        assert run.series[0]["name"] == "cpu" and run.windows
        [cpu] = Summary.from_data(job.utilization).series
        # The busy loop keeps one core busy: near 100% of one core (not 200%: two are held). On a
        # machine busy with other work the job gets less of its core; it says how much it got,
        # and the samples must agree with it.
        [line] = [text for _, text in log_lines(job) if text.startswith("my share of a core:")]
        share = float(line.split(":")[1]) * 100
        middle = statistics.median(w[2][0][0] for w in run.windows)
        assert abs(middle - share) < 25, (run.windows, share)
        if share > 85:
            assert middle > 60, (run.windows, share)
        assert cpu.peak < 150 and cpu.mean > 0
        assert cpu.memory_peak > 1024 * 1024  # a Python process: megabytes at least
        assert job.idle_since is None

    def test_an_idle_job_that_consented_is_flagged_and_stopped_with_a_checkpoint(self, runner, alice, rate, emitted):
        from jobs.models import Checkpoint
        from tests.conftest import make_job
        from tests.test_runner import log_lines, run_job

        job = make_job(alice, script=IDLE_UNTIL_STOPPED, idle_minutes=2, stop_if_idle=True, span_hours=None, ceiling_amount=Decimal("5"))
        job = run_job(runner, job)
        assert job.state == "stopped" and job.reason == "idle for 2 minutes (stop if idle): stopping it"
        assert any(text.startswith("stopping at") for _, text in log_lines(job))
        latest = Checkpoint.objects.filter(job=job).order_by("-written_at").first()
        [artifact] = job.artifacts.all()
        assert artifact.name == f"checkpoints/{latest.name}"  # the weights so far come back
        notices = [e.data["text"] for e in job.events.filter(kind="notice")]
        assert any(n.startswith("idle: every device below 5% busy since") for n in notices)
        [(_kind, kwargs)] = [call for call in emitted if call[0] == "job.idle"]
        assert kwargs["team"] == job.team and kwargs["job"].pk == job.pk and kwargs["data"]["stop_if_idle"] is True

    def test_an_idle_job_without_consent_is_flagged_and_left_running(self, runner, alice, rate, emitted):
        from jobs.models import Job
        from tests.conftest import make_job
        from tests.test_runner import run_job, run_until

        script = b"import time\nprint('waiting', flush=True)\ntime.sleep(4)\nprint('done')\n"
        job = make_job(alice, script=script, idle_minutes=1)
        run_until(runner, lambda: Job.objects.get(pk=job.pk).idle_since is not None)
        assert Job.objects.get(pk=job.pk).state == "running"
        assert [kind for kind, _ in emitted if kind == "job.idle"] == ["job.idle"]
        job = run_job(runner, job)
        assert job.state == "succeeded" and job.idle_since is None


# The job page, the form and the API --------------------------------------------------------------


@pytest.fixture
def wide_job(alice, rate):
    """A finished 8-GPU job of two hours with the recorded samples stored."""
    from datetime import timedelta

    from jobs import states
    from jobs.models import Utilization
    from scheduler.allocations import end_allocation
    from scheduler.models import Allocation, Node
    from tests.conftest import make_job, schedule_now

    Node.objects.create(name="big", device_type="H100", devices=8)
    job = make_job(alice, gpus=8, name="wide", span_hours=Decimal("3"))
    [allocation] = schedule_now()
    Job = type(job)
    Job.objects.get(pk=job.pk).mark_running()
    windows = record(RECORDED_8_GPUS, repeat=50).snapshot()
    Utilization.objects.create(job=job, allocation=allocation, started_at=allocation.started_at, every=2, width=30, series=SERIES_8, windows=windows)
    Job.objects.filter(pk=job.pk).update(utilization=summarize([(SERIES_8, windows)]).as_data())
    end_allocation(allocation, allocation.started_at + timedelta(hours=2), Allocation.EXITED, states.SUCCEEDED, "the process exited with code 0")
    job.refresh_from_db()
    return job


@pytest.mark.django_db
class TestPages:
    def test_a_finished_job_s_page_charts_its_devices_and_hints_at_a_smaller_request(self, client, alice, wide_job):
        client.force_login(alice)
        page = client.get(f"/jobs/{wide_job.pk}/").content.decode()
        assert 'id="util-chart"' in page and 'id="memory-chart"' in page and page.count("<polyline") == 16
        assert "This 8-GPU job kept 1.9 GPUs&#x27; worth busy: a 2-GPU request would have cost about USD 28.80 less." in page
        assert "Peak memory 11 GB of 80 GB." in page
        assert '<td class="mono"><span class="swatch s0"></span>gpu0</td><td class="num">95.5%</td><td class="num">100%</td>' in page

    def test_the_devices_part_alone_for_htmx_and_never_for_an_outsider(self, client, alice, charlie, wide_job):
        client.force_login(alice)
        part = client.get(f"/jobs/{wide_job.pk}/?part=utilization", HTTP_HX_REQUEST="true").content.decode()
        assert part.lstrip().startswith("<section") and 'id="utilization"' in part and "Meter" not in part
        client.force_login(charlie)
        assert client.get(f"/jobs/{wide_job.pk}/?part=utilization", HTTP_HX_REQUEST="true").status_code == 404

    def test_a_running_job_flagged_idle_says_so(self, client, alice, rate):
        from django.utils import timezone

        from jobs.models import Job
        from tests.conftest import make_job

        job = make_job(alice, idle_minutes=45)
        Job.objects.filter(pk=job.pk).update(state="running", idle_since=timezone.now())
        client.force_login(alice)
        page = client.get(f"/jobs/{job.pk}/").content.decode()
        assert 'id="idle-notice"' in page and "below the idle threshold for 45 minutes or more" in page
        assert 'id="idle-flag"' in page and "No samples yet" in page

    def test_the_form_shows_the_hint_of_the_last_job_of_the_same_name(self, client, alice, wide_job):
        client.force_login(alice)
        fields = {"gpus": "8", "mode": "span", "span_hours": "2", "ceiling_kind": "money"}
        part = client.post("/jobs/estimate/", {**fields, "name": "wide"}).content.decode()
        assert 'id="right-size-hint"' in part and "a 2-GPU request would have cost about USD 28.80 less" in part
        assert "right-size-hint" not in client.post("/jobs/estimate/", {**fields, "name": "narrow"}).content.decode()

    def test_the_form_takes_the_idle_settings_and_refuses_a_stop_without_an_idle_time(self, client, alice, rate):
        from jobs.forms import JobForm

        team = alice.membership.team
        base = {"recipe": "", "gpus": 1, "mode": "span", "span_hours": "1", "entrypoint": "train.py"}
        form = JobForm({**base, "idle_minutes": "0", "stop_if_idle": "on"}, team=team)
        assert not form.is_valid() and form.errors["idle_minutes"] == ["Stop if idle needs an idle time of at least 1 minute."]
        form = JobForm({**base, "idle_minutes": "-5"}, team=team)
        assert not form.is_valid() and "idle_minutes" in form.errors
        client.force_login(alice)
        page = client.get("/jobs/new/").content.decode()
        assert 'name="idle_minutes"' in page and 'name="stop_if_idle"' in page


@pytest.mark.django_db
class TestApi:
    @pytest.fixture
    def api(self, client, token, rate):
        client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
        return client

    def submit(self, api, spec):
        import io

        code, data = io.BytesIO(b"print(1)\n"), io.BytesIO(b"x,y\n1,2\n")
        code.name, data.name = "train.py", "train.csv"
        return api.post("/api/jobs/", {"spec": json.dumps(spec), "code": code, "data": data})

    def test_a_spec_sets_the_idle_time_and_consent(self, api):
        from jobs import specfile
        from jobs.models import Job

        response = self.submit(api, {"gpus": 1, "span_hours": 1, "idle_minutes": 10, "stop_if_idle": True})
        assert response.status_code == 201, response.json()
        body = response.json()
        assert body["idle_minutes"] == 10 and body["stop_if_idle"] is True and body["idle_since"] is None and body["utilization"] is None
        job = Job.objects.get(pk=body["id"])
        assert specfile.job_spec(job)["request"]["idle_minutes"] == 10 and specfile.job_spec(job)["request"]["stop_if_idle"] is True

    def test_bad_idle_values_are_a_400_with_a_reason(self, api):
        response = self.submit(api, {"gpus": 1, "span_hours": 1, "stop_if_idle": "yes"})
        assert response.status_code == 400 and "stop_if_idle must be true or false" in response.json()["errors"]["stop_if_idle"][0]
        response = self.submit(api, {"gpus": 1, "span_hours": 1, "idle_minutes": -1})
        assert response.status_code == 400 and "idle_minutes" in response.json()["errors"]

    def test_a_finished_job_s_summary_is_in_the_api(self, api, wide_job):
        body = api.get(f"/api/jobs/{wide_job.pk}/").json()
        assert body["utilization"]["busy"] == pytest.approx(1.9, abs=0.02) and len(body["utilization"]["series"]) == 8


@pytest.mark.nodb
def test_memory_in_a_hint_reads_at_any_size():
    from jobs.utilization import gb

    assert [gb(11 * 1024**2), gb(2.5 * 1024**3), gb(80 * 1024**3)] == ["11 MB", "2.5 GB", "80 GB"]
