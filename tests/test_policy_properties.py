"""Properties of every policy over random queues, nodes and arrivals, simulated to the end:
no device is ever held by two jobs at once, every job starts and finishes, and none starts
before its not-before time (scheduler.simulator also checks each placement as it applies it)."""

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import policy
from scheduler import simulator as S
from scheduler.policy import NodeState


@st.composite
def worlds(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    nodes = [NodeState(f"n{i}", "gpu", size, tuple(range(size))) for i, size in enumerate(sizes)]
    total = sum(sizes)
    jobs = []
    for k in range(draw(st.integers(1, 12))):
        submit = float(draw(st.integers(0, 2000)))
        duration = float(draw(st.integers(1, 3000)))
        jobs.append(
            S.TraceJob(
                id=f"j{k}",
                submit=submit,
                gpus=draw(st.integers(1, total)),
                duration=duration,
                estimate=duration * draw(st.sampled_from([0.5, 1.0, 1.5, 3.0])),  # some under-estimate
                deadline=draw(st.none() | st.just(submit + duration * draw(st.sampled_from([0.8, 1.5, 4.0])))),
                team=draw(st.sampled_from(["a", "b", "c"])),
                preemptible=draw(st.booleans()),
                not_before=draw(st.none() | st.just(submit + draw(st.integers(0, 5000)))),
            )
        )
    return nodes, jobs, draw(st.sampled_from(sorted(policy.POLICIES)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_no_double_booking_every_job_runs_and_not_before_holds(world):
    nodes, jobs, name = world
    result = S.simulate(jobs, nodes, name)
    assert result.stuck == []
    held = {}  # (node, device) -> [(start, end)]
    for job in jobs:
        outcome = result.outcomes[job.id]
        assert outcome.first_start is not None and outcome.finish is not None
        assert outcome.first_start >= job.submit
        if job.not_before is not None:
            assert outcome.first_start >= job.not_before
        worked = 0.0
        for start, end, parts in outcome.runs:
            assert sum(len(devices) for _, devices in parts) == job.gpus
            worked += end - start
            for node_id, devices in parts:
                for d in devices:
                    held.setdefault((node_id, d), []).append((start, end))
        assert abs(worked - job.duration) < 1e-6  # preempted work resumes from its checkpoint
        assert outcome.preemptions == 0 or job.preemptible
    for spans in held.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end
