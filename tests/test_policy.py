from datetime import datetime, timedelta, timezone

from scheduler.policy import NodeState, QueuedJob, place_fcfs

NOW = datetime(2026, 12, 2, 23, 0, tzinfo=timezone.utc)


def job(id, gpus, minutes_ago, **kw):
    return QueuedJob(id=id, gpus=gpus, submitted_at=NOW - timedelta(minutes=minutes_ago), **kw)


def node(id, devices, free=None, device_type="cpu"):
    return NodeState(id=id, device_type=device_type, devices=devices, free=tuple(range(devices) if free is None else free))


def test_first_come_first_served():
    plan = place_fcfs([job("late", 1, 1), job("early", 1, 5)], [node("n", 1)], NOW)
    assert [(p.job_id, p.devices) for p in plan.placements] == [("early", (0,))]
    assert plan.waiting["late"] == "waiting for 1 device on one node; at most 0 free"


def test_a_job_that_does_not_fit_holds_back_later_jobs():
    plan = place_fcfs([job("big", 4, 5), job("small", 1, 1)], [node("n", 4, free=(2, 3))], NOW)
    assert plan.placements == []
    assert plan.waiting["big"] == "waiting for 4 devices on one node; at most 2 free"
    assert "behind job big" in plan.waiting["small"]


def test_gangs_go_on_one_node_best_fit():
    nodes = [node("roomy", 8), node("snug", 4, free=(1, 2))]
    plan = place_fcfs([job("a", 2, 3)], nodes, NOW)
    assert [(p.node_id, p.devices) for p in plan.placements] == [("snug", (1, 2))]


def test_devices_are_not_handed_out_twice_in_one_cycle():
    plan = place_fcfs([job("a", 1, 3), job("b", 1, 2), job("c", 1, 1)], [node("n", 2)], NOW)
    assert [(p.job_id, p.devices) for p in plan.placements] == [("a", (0,)), ("b", (1,))]
    assert "c" in plan.waiting


def test_not_before_is_respected_and_holds_no_one_back():
    later = NOW + timedelta(hours=2)
    plan = place_fcfs([job("tomorrow", 1, 5, not_before=later), job("now", 1, 1)], [node("n", 1)], NOW)
    assert [p.job_id for p in plan.placements] == ["now"]
    assert plan.waiting["tomorrow"].startswith("not before")


def test_a_job_no_node_can_hold_waits_without_blocking():
    plan = place_fcfs([job("huge", 16, 5), job("small", 1, 1)], [node("n", 8)], NOW)
    assert [p.job_id for p in plan.placements] == ["small"]
    assert "none is online" in plan.waiting["huge"]


def test_a_gpu_type_is_matched():
    nodes = [node("cpu-node", 4), node("gpu-node", 2, device_type="H100")]
    plan = place_fcfs([job("a", 1, 2, gpu_type="H100")], nodes, NOW)
    assert [p.node_id for p in plan.placements] == ["gpu-node"]


def test_no_nodes_no_placements():
    plan = place_fcfs([job("a", 1, 1)], [], NOW)
    assert plan.placements == [] and "none is online" in plan.waiting["a"]
