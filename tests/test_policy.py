from datetime import datetime, timedelta, timezone

from scheduler.policy import NodeState, QueuedJob, Running, choose_preemptions, place_fcfs

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


# Preemption ------------------------------------------------------------------------------------

def running(id, node_id, devices, minutes_ago, preemptible=True, preempting=False):
    return Running(id, node_id, tuple(devices), preemptible, NOW - timedelta(minutes=minutes_ago), preempting)


def preemptions(queue, nodes, allocations):
    plan = place_fcfs(queue, nodes, NOW)
    return choose_preemptions(plan, queue, nodes, allocations, NOW)


def test_a_job_that_is_not_preemptible_preempts_the_youngest_preemptible_ones():
    nodes = [node("n1", 4, free=())]
    allocations = [running("old", "n1", [0, 1], 30), running("young", "n1", [2], 5), running("fixed", "n1", [3], 1, preemptible=False)]
    victims, notes = preemptions([job("urgent", 1, 0)], nodes, allocations)
    assert victims == ["young"]
    assert notes == {"urgent": "preempting 1 preemptible job to make room"}
    victims, _ = preemptions([job("big", 3, 0)], nodes, allocations)
    assert sorted(victims) == ["old", "young"]


def test_a_preemptible_job_preempts_no_one_and_nothing_is_preempted_that_would_not_be_enough():
    nodes = [node("n1", 2, free=())]
    allocations = [running("a", "n1", [0], 5), running("b", "n1", [1], 5, preemptible=False)]
    assert preemptions([job("cheap", 1, 0, preemptible=True)], nodes, allocations) == ([], {})
    assert preemptions([job("big", 2, 0)], nodes, allocations) == ([], {})


def test_devices_already_being_given_back_are_counted_and_not_preempted_twice():
    nodes = [node("n1", 2, free=())]
    allocations = [running("going", "n1", [0], 5, preempting=True), running("other", "n1", [1], 1)]
    victims, notes = preemptions([job("urgent", 1, 0)], nodes, allocations)
    assert victims == [] and "preempting 1" in notes["urgent"]


def test_preemption_waits_for_the_data_and_the_not_before_time():
    nodes = [node("n1", 1, free=())]
    allocations = [running("a", "n1", [0], 5)]
    assert preemptions([job("urgent", 1, 0, staged_on=frozenset())], nodes, allocations) == ([], {})
    later = job("later", 1, 0, not_before=NOW + timedelta(hours=1))
    assert preemptions([later], nodes, allocations) == ([], {})


def test_two_waiting_jobs_do_not_count_the_same_freed_devices():
    nodes = [node("n1", 2, free=())]
    allocations = [running("a", "n1", [0], 5), running("b", "n1", [1], 6)]
    victims, _ = preemptions([job("u1", 1, 2), job("u2", 1, 1)], nodes, allocations)
    assert sorted(victims) == ["a", "b"]


def test_preemptible_jobs_queue_behind_the_others():
    nodes = [node("n1", 1)]
    plan = place_fcfs([job("cheap", 1, 10, preemptible=True), job("urgent", 1, 0)], nodes, NOW)
    assert [p.job_id for p in plan.placements] == ["urgent"]
