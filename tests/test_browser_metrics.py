"""A job's metrics and checkpoints in a real browser: Chromium, driven by Playwright, against a
live system (web server and scheduler; no runner: the job's events are written straight into
the system's database, as a runner would write them).

Open the page of a job that logged a few thousand metric points (and was resumed from a
checkpoint, so some steps came twice): a chart per series is drawn, with the latest values as
text. Then new points, a NaN, a checkpoint and a resume arrive while the page is open, and the
page follows them live. Screenshots go to test-artifacts/ at the repository root (git-ignored).
"""

import json
import textwrap

import pytest
from playwright.sync_api import expect

from tests.browser import log_in, shot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def system(web_system):
    """No runner: the events are written here, as a runner would (and the job stays queued)."""
    return web_system


def django(system, code):
    """Run Python with Django set up against the live system's database; returns its output."""
    return system.manage("shell", "-c", textwrap.dedent(code)).strip()


SETUP = """
    import math, random
    from datetime import timedelta
    from django.contrib.auth import get_user_model
    from django.utils import timezone
    from jobs.models import Job, JobEvent

    user = get_user_model().objects.get(username="demo")
    job = Job.objects.create(
        team=user.membership.team, created_by=user, name="metrics-browser", entrypoint="train.py", gpus=1,
        span_hours=1, keep_checkpoints=2, early_stop_metric="heldout_accuracy", early_stop_mode="max",
        early_stop_patience=5,
    )
    job.record("state", data={"state": "queued", "from": None, "reason": "submitted"})
    random.seed(1)
    start = timezone.now() - timedelta(hours=1)

    def point(step):
        values = {"loss": 2.3 * math.exp(-step / 400) + 0.08 + random.uniform(-0.04, 0.04),
                  "lr": 0.001 * 0.5 * (1 + math.cos(math.pi * step / 3000))}
        if step % 50 == 0:
            values["heldout_accuracy"] = min(0.99, 1 - 0.9 * math.exp(-step / 300) + random.uniform(-0.01, 0.01))
        return JobEvent(kind="metric", at=start + timedelta(seconds=step), data={"step": step, "values": values})

    # Steps 1-1200, then the run resumed from its checkpoint at step 1000 and did 1001-2400 again.
    JobEvent.append(job.pk, [point(s) for s in range(1, 1201)])
    job.record("resume", data={"name": "step-000000001000.pt", "step": 1000,
                               "text": "resumed from step-000000001000.pt (step 1000)"})
    JobEvent.append(job.pk, [point(s) for s in range(1001, 2401)])
    print(job.pk)
"""


def add_events(system, job_id, code):
    """Run code with `job` and `now` set, as a runner writing the job's events."""
    header = textwrap.dedent(f"""
        from django.utils import timezone
        from jobs.models import Checkpoint, Job, JobEvent
        job = Job.objects.get(pk="{job_id}")
        now = timezone.now()
    """)
    django(system, header + textwrap.dedent(code))


def chart_points(page, name):
    """How many points the polylines of a series' chart hold."""
    return page.evaluate(
        """(name) => {
          const fig = [...document.querySelectorAll('#metric-charts figure')].find(f => f.dataset.series === name);
          if (!fig) return 0;
          return [...fig.querySelectorAll('svg polyline')].reduce((n, p) => n + p.points.numberOfItems, 0);
        }""",
        name,
    )


def test_metrics_are_charted_and_follow_the_run_live(page, system):
    job_id = django(system, SETUP).splitlines()[-1]
    log_in(page)
    fetched = []  # the card fragments htmx fetches again
    page.on("response", lambda r: fetched.append(r.url) if "part=checkpoints" in r.url and r.status == 200 else None)
    page.goto(f"/jobs/{job_id}/")

    # A chart per series, drawn from the page's data.
    charts = page.locator("#metric-charts figure")
    expect(charts).to_have_count(3)
    for name in ("heldout_accuracy", "loss", "lr"):
        assert chart_points(page, name) > 20, name
    loss_chart = page.locator('#metric-charts figure[data-series="loss"]')
    expect(loss_chart.locator("svg text").first).to_be_visible()  # tick labels
    # The resume rewound the series: the x axis ends at step 2400, never goes back.
    data = json.loads(page.locator("#metrics-data").text_content())
    steps = [p[0] for p in data["series"]["loss"]]
    assert steps == sorted(steps) and steps[-1] == 2400 and len(steps) <= 1000
    # The latest values as text, and the best of each series that has a direction.
    loss_row = page.locator('#metric-rows tr[data-series="loss"]')
    expect(loss_row.locator(".step")).to_have_text("2400")
    expect(loss_row.locator(".count")).to_have_text("2400")
    expect(page.locator('#metric-rows tr[data-series="heldout_accuracy"] .best')).to_contain_text("at ")
    expect(page.locator('#metric-rows tr[data-series="lr"] .best')).to_have_text("")
    expect(page.locator("#timeline")).to_contain_text("resumed from step-000000001000.pt (step 1000)")
    expect(page.locator("body")).to_have_attribute("data-live", "1")
    shot(page, "job-metrics.png")

    # Hovering a chart reads out the point under the pointer.
    svg = loss_chart.locator("svg")
    box = svg.bounding_box()
    svg.hover(position={"x": box["width"] * 0.5, "y": box["height"] * 0.5})
    expect(loss_chart.locator(".readout")).to_contain_text("at step 1")
    expect(loss_chart.locator("svg line.guide")).to_have_count(1)
    loss_chart.screenshot(path=str(shot_path("job-metrics-hover.png")))
    page.mouse.move(0, 0)

    # New points while the page is open: the latest value follows, the chart grows.
    before = chart_points(page, "loss")
    add_events(
        system,
        job_id,
        """
        JobEvent.append(job.pk, [
            JobEvent(kind="metric", at=now, data={"step": 2401, "values": {"loss": 0.0123, "lr": 0.0001}}),
            JobEvent(kind="metric", at=now, data={"step": 2402, "values": {"loss": 0.0117, "brand_new": 7}}),
        ])
    """,
    )
    expect(loss_row.locator(".latest")).to_have_text("0.0117", timeout=15_000)
    expect(loss_row.locator(".step")).to_have_text("2402")
    expect(loss_chart.locator(".readout")).to_contain_text("latest 0.0117 at step 2402")
    expect(page.locator('#metric-rows tr[data-series="brand_new"] .latest')).to_have_text("7")
    expect(charts).to_have_count(4)
    assert chart_points(page, "loss") >= before  # redrawn with the new points (and never fewer)

    # A NaN: a gap in the chart, shown as what it is.
    add_events(
        system,
        job_id,
        """
        JobEvent.append(job.pk, [JobEvent(kind="metric", at=now, data={"step": 2403, "values": {"loss": "NaN"}})])
    """,
    )
    expect(loss_row.locator(".latest")).to_have_text("NaN", timeout=15_000)
    expect(loss_row.locator(".count")).to_contain_text("(1 not finite)")
    expect(loss_chart.locator("svg line.nonfinite")).to_have_count(1)

    # A checkpoint kept while the page is open: listed, on the timeline, downloadable.
    add_events(
        system,
        job_id,
        """
        import io
        from core.storage import get_storage
        for step in (2000, 2400):
            name = f"step-{step:012d}.pt"
            key = f"jobs/{job.pk}/checkpoints/{name}"
            size, sha256 = get_storage().save(key, io.BytesIO(b"w" * 1000 * step))
            Checkpoint.objects.create(job=job, name=name, step=step, key=key, size=size, sha256=sha256, written_at=now)
            job.record("checkpoint", at=now, data={"name": name, "step": step, "size": size, "node": "node-a",
                                                   "text": f"checkpoint {name} kept (step {step})"})
    """,
    )
    rows = page.locator("#checkpoint-rows li")
    expect(rows).to_have_count(2, timeout=15_000)
    expect(rows.first).to_contain_text("step-000000002400.pt")
    expect(page.locator("#timeline")).to_contain_text("checkpoint step-000000002400.pt kept (step 2400)")
    link = page.locator("#checkpoint-rows a", has_text="step-000000002400.pt")
    expect(link).to_be_visible()
    response = page.request.get(link.get_attribute("href"))
    assert response.status == 200 and len(response.body()) == 2_400_000

    # A third: the job keeps 2, so the oldest is pruned (deleted from storage), greyed, no link.
    # (What was fetched before is forgotten first: on a busy machine the card's refetch can come
    # back before this test gets to look for it.)
    fetched.clear()
    add_events(
        system,
        job_id,
        """
        import io
        from core.storage import get_storage
        name = "step-000000002402.pt"
        key = f"jobs/{job.pk}/checkpoints/{name}"
        size, sha256 = get_storage().save(key, io.BytesIO(b"w" * 5000))
        Checkpoint.objects.create(job=job, name=name, step=2402, key=key, size=size, sha256=sha256, written_at=now)
        oldest = Checkpoint.objects.get(job=job, step=2000)
        get_storage().delete(oldest.key)
        Checkpoint.objects.filter(pk=oldest.pk).update(pruned_at=now)
        job.record("checkpoint", at=now, data={"name": name, "step": 2402, "size": size, "node": "node-a",
                                               "text": f"checkpoint {name} kept (step 2402)"})
    """,
    )
    expect(rows).to_have_count(3, timeout=15_000)
    pruned = page.locator('#checkpoint-rows li[data-name="step-000000002000.pt"]')
    expect(pruned).to_have_class("pruned")
    expect(pruned.locator("a")).to_have_count(0)
    expect(pruned).to_contain_text("pruned")
    # The card is fetched again from the server a moment later: the same three.
    for _ in range(50):  # (waiting in Playwright: its events are taken in meanwhile)
        if fetched:
            break
        page.wait_for_timeout(200)
    assert fetched, "the checkpoints card was not fetched again"
    expect(rows).to_have_count(3)
    expect(pruned).to_have_class("pruned")
    expect(page.locator("#checkpoint-rows a")).to_have_count(2)
    gone = page.request.get(f"/jobs/{job_id}/checkpoints/step-000000002000.pt")
    assert gone.status == 410 and "deleted from storage" in gone.text()

    # The card fetched again can come back holding a checkpoint whose event has not reached the
    # page yet (a busy machine): the event then finds its row there and adds no second one.
    add_events(
        system,
        job_id,
        """
        from core.storage import get_storage
        import io
        name = "step-000000002404.pt"
        key = f"jobs/{job.pk}/checkpoints/{name}"
        size, sha256 = get_storage().save(key, io.BytesIO(b"w" * 5000))
        Checkpoint.objects.create(job=job, name=name, step=2404, key=key, size=size, sha256=sha256, written_at=now)
    """,
    )
    page.evaluate("document.body.dispatchEvent(new Event('checkpoint-kept'))")
    newest = page.locator('#checkpoint-rows li[data-name="step-000000002404.pt"]')
    expect(newest).to_have_count(1, timeout=15_000)
    add_events(
        system,
        job_id,
        """
        job.record("checkpoint", at=now, data={"name": "step-000000002404.pt", "step": 2404, "size": 5000, "node": "node-a",
                                               "text": "checkpoint step-000000002404.pt kept (step 2404)"})
    """,
    )
    expect(page.locator("#timeline")).to_contain_text("checkpoint step-000000002404.pt kept (step 2404)")
    # Looked at once, not waited for: the event's row would be there with its timeline entry,
    # and the card fetched again a second later would hide it.
    assert newest.count() == 1
    assert rows.count() == 4
    shot(page, "job-metrics-live.png")
    page.locator("#metrics").screenshot(path=str(shot_path("job-metrics-card.png")))


def shot_path(name):
    from tests.browser import SHOTS

    return SHOTS / name
