"""The placement policy on small hand-made queues: no database. Times are epoch seconds."""

from datetime import UTC, datetime

import pytest

from scheduler import policy
from scheduler.policy import NodeState, Placement, QueuedJob, Running, choose_preemptions, place_fcfs, plan

NOW = datetime(2026, 12, 2, 23, 0, tzinfo=UTC).timestamp()
MIN, HOUR = 60.0, 3600.0


def job(id, gpus, minutes_ago, **kw):
    return QueuedJob(id=id, gpus=gpus, submitted_at=NOW - minutes_ago * MIN, **kw)


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
    later = NOW + 2 * HOUR
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


def running(id, node_id, devices, minutes_ago, preemptible=True, preempting=False, **kw):
    return Running(id, node_id, tuple(devices), preemptible, NOW - minutes_ago * MIN, preempting=preempting, **kw)


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
    later = job("later", 1, 0, not_before=NOW + HOUR)
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


# plan(): the rules of the policy "ours" and its baselines ----------------------------------------


def ids(result):
    return [p.job_id for p in result.placements]


def test_placements_keep_the_one_node_constructor_and_name_their_parts():
    one = Placement("j", "n1", (0, 1))
    assert one.parts == (("n1", (0, 1)),) and one.node_id == "n1" and one.devices == (0, 1) and one.gpus == 2
    two = Placement("j", (("n1", (0,)), ("n2", (3,))))
    assert two.gpus == 2
    with pytest.raises(ValueError):
        two.node_id  # noqa: B018 - a gang on two nodes has no one node


def test_decayed_usage_halves_every_half_life():
    records = [("a", 100.0, NOW), ("a", 100.0, NOW - 2 * HOUR), ("b", 80.0, NOW - HOUR)]
    usage = policy.decayed_usage(records, NOW, half_life=HOUR)
    assert usage == pytest.approx({"a": 125.0, "b": 40.0})


def test_fair_share_factor_is_slurms_classic():
    assert policy.fair_share_factor("new", {}, None) == 1.0
    usage = {"a": 50.0, "b": 50.0}
    assert policy.fair_share_factor("a", usage) == pytest.approx(0.5)  # used exactly its half
    assert policy.fair_share_factor("c", usage) == pytest.approx(1.0)  # used nothing
    assert policy.fair_share_factor("a", {"a": 100.0, "b": 0.0}) == pytest.approx(0.25)  # all of it, share 1/2
    # Operator shares: a team with three times the share is hit less by the same usage.
    assert policy.fair_share_factor("a", usage, {"a": 3, "b": 1}) == pytest.approx(2 ** (-0.5 / 0.75))


def test_a_team_that_used_a_lot_yields_to_one_that_did_not():
    queue = [job("heavy-job", 1, 30, team="heavy"), job("light-job", 1, 1, team="light")]
    result = plan(queue, [node("n", 1)], [], NOW, usage={"heavy": 1e6})
    assert ids(result) == ["light-job"]
    assert result.waiting["heavy-job"].startswith("waiting for 1 device")
    # Without the usage, the same two jobs go by size then submission: equal, so "heavy-job" first.
    assert ids(plan(queue, [node("n", 1)], [], NOW)) == ["heavy-job"]


def test_running_allocations_count_as_usage():
    hog = Running("a1", "n2", (0, 1, 2, 3), False, NOW - 10 * HOUR, job_id="x", team="heavy", expected_end=NOW + HOUR)
    queue = [job("heavy-job", 1, 30, team="heavy"), job("light-job", 1, 1, team="light")]
    assert ids(plan(queue, [node("n", 1), node("n2", 4, free=())], [hog], NOW)) == ["light-job"]


def test_a_blocked_job_gets_a_reservation_and_only_harmless_jobs_backfill():
    # n1: 4 devices, 2 of them held until NOW + 1 h; n2: 2 devices, free.
    nodes = [node("n1", 4, free=(2, 3)), node("n2", 2)]
    held = [running("r", "n1", [0, 1], 30, preemptible=False, expected_end=NOW + HOUR)]
    queue = [
        job("big", 4, 10, expected_seconds=10 * MIN),  # first in line either way, does not fit
        job("short", 1, 8, expected_seconds=30 * MIN),  # ends before the reservation: backfilled on n1
        job("aside", 2, 7, expected_seconds=3 * HOUR),  # devices the reservation does not need (n2): runs
        job("long", 1, 6, expected_seconds=5 * HOUR),  # would hold n1's last device past it: waits
    ]
    for name in ("ours", "easy", "edf"):
        result = plan(queue, nodes, held, NOW, policy=name)
        assert sorted(p.parts for p in result.placements) == [(("n1", (2,)),), (("n2", (0, 1)),)], name
        assert sorted(ids(result)) == ["aside", "short"], name
        assert result.reservations == {"big": NOW + HOUR}
        assert result.waiting["big"] == "waiting for 4 devices on one node; at most 2 free; reserved from 00:00 UTC"
        assert result.waiting["long"] == "waiting: starting now would delay job big, which has devices reserved from 00:00 UTC"
        assert result.wake_at == NOW + HOUR


def test_a_reservation_takes_the_devices_released_last_so_what_is_free_now_can_backfill():
    # n1: 8 devices; 0-3 free now, 4-7 held until NOW + 1 h. "big" needs 6: from NOW + 1 h it
    # must take 4-7 and two of 0-3, leaving two free now for a long job beside it. Taking the
    # lowest-numbered devices (0-5) would leave none and hold "long" back for nothing.
    nodes = [node("n1", 8, free=(0, 1, 2, 3))]
    held = [running("r", "n1", [4, 5, 6, 7], 30, preemptible=False, expected_end=NOW + HOUR)]
    queue = [job("big", 6, 10, expected_seconds=HOUR), job("long", 2, 5, expected_seconds=5 * HOUR)]
    for name in ("ours", "easy", "edf"):
        result = plan(queue, nodes, held, NOW, policy=name)
        assert result.reservations == {"big": NOW + HOUR}, name
        assert ids(result) == ["long"], (name, result.waiting)
        assert len(result.placements[0].parts[0][1]) == 2


def test_fifo_does_not_backfill_and_sjf_does_not_reserve():
    nodes = [node("n1", 4, free=(2, 3))]
    held = [running("r", "n1", [0, 1], 30, preemptible=False, expected_end=NOW + HOUR)]
    queue = [job("big", 4, 10, expected_seconds=10 * MIN), job("small", 1, 5, expected_seconds=2 * HOUR)]
    fifo = plan(queue, nodes, held, NOW, policy="fifo")
    assert ids(fifo) == [] and "behind job big" in fifo.waiting["small"]
    sjf = plan(queue, nodes, held, NOW, policy="sjf")
    assert ids(sjf) == ["small"]  # big is first by size, but nothing is held for it
    assert sjf.reservations == {}
    assert ids(plan(queue, nodes, held, NOW, policy="easy")) == []  # small would delay big


def test_a_job_with_a_tighter_slack_goes_first():
    queue = [
        job("relaxed", 1, 20, expected_seconds=HOUR, deadline=NOW + HOUR + 20 * MIN),
        job("tight", 1, 1, expected_seconds=HOUR, deadline=NOW + HOUR + 5 * MIN),
        job("plain", 1, 30, expected_seconds=10 * MIN),  # smaller, but no deadline
    ]
    result = plan(queue, [node("n", 1)], [], NOW)
    assert ids(result) == ["tight"]
    assert result.infeasible == set()
    assert ids(plan(queue, [node("n", 2)], [], NOW)) == ["tight", "relaxed"]


def test_a_deadline_that_can_no_longer_be_met_is_flagged_and_does_not_jump_the_queue():
    queue = [
        job("late", 1, 60, expected_seconds=5 * HOUR, deadline=NOW + 3 * HOUR),
        job("feasible", 1, 1, expected_seconds=5 * HOUR, deadline=NOW + 5 * HOUR + 10 * MIN),
    ]
    result = plan(queue, [node("n", 1)], [], NOW)
    assert ids(result) == ["feasible"]
    assert result.infeasible == {"late"}
    assert result.waiting["late"].startswith("its deadline can no longer be met: it needs 5 h and 3 h are left; ")
    # Under EDF the earlier deadline goes first even though it cannot be met.
    assert ids(plan(queue, [node("n", 1)], [], NOW, policy="edf")) == ["late"]
    # Flagged, not starved: alone, it runs.
    alone = plan(queue[:1], [node("n", 1)], [], NOW)
    assert ids(alone) == ["late"] and alone.infeasible == {"late"}


def test_a_job_that_waited_past_its_patience_goes_first_and_holds_the_reservation():
    nodes = [node("n1", 4, free=(1, 2, 3))]
    held = [running("r", "n1", [0], 30, preemptible=False, expected_end=NOW + HOUR)]
    old = job("old-big", 4, 21 * HOUR / MIN, expected_seconds=20 * HOUR)  # its patience: its 20 h
    small = job("small", 1, 1, expected_seconds=2 * HOUR)
    result = plan([old, small], nodes, held, NOW)
    assert ids(result) == [] and result.reservations == {"old-big": NOW + HOUR}
    # Younger than its patience (two hours at least), it would be the larger job and the small one would start.
    young = job("young-big", 4, HOUR / MIN, expected_seconds=20 * HOUR)
    assert ids(plan([young, small], nodes, held, NOW)) == ["small"]
    # However long a job, three days is the most it waits before it is protected.
    assert policy.patience(job("x", 1, 0, expected_seconds=30 * 86400)) == policy.STARVE_CAP == 3 * 86400
    assert policy.patience(job("y", 1, 0, expected_seconds=60)) == policy.STARVE_MIN == 2 * HOUR


def test_a_long_job_is_protected_once_it_waited_past_when_fifo_would_have_reached_it():
    """Patience is the shorter of the job's expected duration and two hours past its FIFO drain
    time: (the running allocations' GPU-seconds left + those of the jobs queued before it) / GPUs."""
    nodes = [node("n1", 4, free=(1, 2, 3))]
    held = [running("r", "n1", [0], 30, preemptible=False, expected_end=NOW + HOUR)]  # 1 GPU-hour left: 15 min on 4 GPUs
    long = job("long", 4, 3 * HOUR / MIN, expected_seconds=40 * HOUR)  # its patience: 2 h 15 min, not its 40 h
    small = job("small", 1, 1, expected_seconds=2 * HOUR)
    assert policy.patience(long, 15 * MIN) == 2 * HOUR + 15 * MIN
    result = plan([long, small], nodes, held, NOW)
    assert ids(result) == [] and result.reservations == {"long": NOW + HOUR}
    # Before that, it is the larger job and the small one starts.
    fresh = job("long", 4, 2 * HOUR / MIN, expected_seconds=40 * HOUR)
    assert ids(plan([fresh, small], nodes, held, NOW)) == ["small"]
    # Behind 20 GPU-hours queued before it, FIFO reaches it in 5 h 15 min: it is not starving yet,
    # the job before it is.
    ahead = job("ahead", 4, 5 * HOUR / MIN, expected_seconds=5 * HOUR)
    result = plan([ahead, long, small], nodes, held, NOW)
    assert ids(result) == [] and result.reservations == {"ahead": NOW + HOUR}


def test_one_starving_job_is_protected_at_a_time_the_rest_stay_shortest_first():
    """Where waits run to days most of the queue has waited long: protecting every such job,
    oldest first, was FIFO. One goes first (the most times past its patience); the rest keep
    their order, so a short job still passes a long one that waited longer."""
    nodes = [node("n1", 2)]
    queue = [
        job("old-1", 1, 96 * HOUR / MIN, expected_seconds=50 * HOUR),  # 1.92x its patience
        job("old-2", 1, 84 * HOUR / MIN, expected_seconds=50 * HOUR),  # 1.68x
        job("short", 1, 10, expected_seconds=HOUR),
    ]
    assert sorted(ids(plan(queue, nodes, [], NOW))) == ["old-1", "short"]


def test_gangs_go_best_fit_and_keep_whole_nodes_free():
    nodes = [node("whole", 8), node("partial", 8, free=(5, 6, 7)), node("snug", 8, free=(6, 7))]
    result = plan([job("a", 2, 3)], nodes, [], NOW)
    assert [p.parts for p in result.placements] == [(("snug", (6, 7)),)]
    result = plan([job("b", 3, 3)], nodes, [], NOW)
    assert [p.parts for p in result.placements] == [(("partial", (5, 6, 7)),)]
    result = plan([job("c", 4, 3)], nodes, [], NOW)
    assert [p.parts for p in result.placements] == [(("whole", (0, 1, 2, 3)),)]


def test_jobs_larger_than_a_node_take_whole_nodes():
    nodes = [node("n1", 8), node("n2", 8, free=(7,)), node("n3", 8), node("n4", 8, free=(4, 5, 6, 7))]
    result = plan([job("g16", 16, 3)], nodes, [], NOW)
    assert [p.parts for p in result.placements] == [(("n1", tuple(range(8))), ("n3", tuple(range(8))))]
    result = plan([job("g12", 12, 3)], nodes, [], NOW)
    assert [p.parts for p in result.placements] == [(("n1", tuple(range(8))), ("n4", (4, 5, 6, 7)))]
    result = plan([job("g24", 24, 3)], nodes, [], NOW)
    assert result.placements == []
    assert result.waiting["g24"].startswith("waiting for 24 devices on whole nodes; 21 free, 2 whole nodes")
    assert plan([job("g64", 64, 3)], nodes, [], NOW).waiting["g64"] == "waiting for 64 devices; the online nodes have 32 in all"


def test_data_not_staged_on_a_node_keeps_the_job_off_it():
    nodes = [node("n1", 2), node("n2", 2)]
    result = plan([job("a", 1, 3, staged_on=frozenset({"n2"}))], nodes, [], NOW)
    assert [p.node_id for p in result.placements] == ["n2"]
    result = plan([job("a", 1, 3, staged_on=frozenset(), staging_note="staging its data on n1: 40% done"), job("b", 1, 1)], [node("n1", 1)], [], NOW)
    assert ids(result) == ["b"] and result.waiting["a"] == "staging its data on n1: 40% done"


def test_not_before_is_respected_and_the_plan_wakes_for_it():
    later = datetime(2026, 12, 3, 6, 0, tzinfo=UTC).timestamp()
    result = plan([job("tomorrow", 1, 5, not_before=later), job("now", 1, 1, expected_seconds=9 * HOUR)], [node("n", 2)], [], NOW)
    assert ids(result) == ["now"]
    assert result.waiting["tomorrow"] == "not before 2026-12-03 06:00 UTC"
    assert result.wake_at == later
    assert ids(plan([job("tomorrow", 1, 5, not_before=later)], [node("n", 2)], [], later)) == ["tomorrow"]


def test_preemption_to_meet_a_deadline_names_it_and_spares_jobs_preempted_within_the_hour():
    nodes = [node("n1", 2, free=())]
    cheap = [running("c1", "n1", [0, 1], 30, expected_end=NOW + 5 * HOUR, job_id="cj")]
    urgent = job("urgent", 2, 1, expected_seconds=HOUR, deadline=NOW + 2 * HOUR)
    result = plan([urgent], nodes, cheap, NOW)
    assert result.preempt == ["c1"] and result.placements == []
    assert result.preempt_reasons["c1"].startswith("job urgent needs its devices to meet its deadline (01:00 UTC)")
    assert result.waiting["urgent"] == "preempting 1 preemptible job to make room"
    recently = [running("c1", "n1", [0, 1], 30, expected_end=NOW + 5 * HOUR, last_preempted_at=NOW - 20 * MIN)]
    spared = plan([urgent], nodes, recently, NOW)
    assert spared.preempt == [] and "reserved from" in spared.waiting["urgent"]
    long_ago = [running("c1", "n1", [0, 1], 30, expected_end=NOW + 5 * HOUR, last_preempted_at=NOW - 61 * MIN)]
    assert plan([urgent], nodes, long_ago, NOW).preempt == ["c1"]


def test_plan_keeps_the_rule_that_jobs_not_preemptible_preempt_preemptible_ones():
    nodes = [node("n1", 4, free=())]
    allocations = [running("old", "n1", [0, 1], 30), running("young", "n1", [2], 5), running("fixed", "n1", [3], 1, preemptible=False)]
    result = plan([job("plain", 1, 0)], nodes, allocations, NOW)
    assert result.preempt == ["young"]
    assert result.preempt_reasons == {"young": "a job that is not preemptible needs its devices"}
    assert plan([job("cheap", 1, 0, preemptible=True)], nodes, allocations, NOW).preempt == []
    assert sorted(plan([job("big", 3, 0)], nodes, allocations, NOW).preempt) == ["old", "young"]


def test_preemptible_jobs_queue_behind_the_others_in_every_policy():
    for name in sorted(policy.POLICIES):
        result = plan([job("cheap", 1, 10, preemptible=True, expected_seconds=60), job("plain", 1, 0)], [node("n1", 1)], [], NOW, policy=name)
        assert ids(result) == ["plain"], name


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        plan([], [], [], NOW, policy="random")


def test_predict_plays_the_queue_out_with_expected_durations():
    nodes = [node("n", 1, free=())]
    held = [running("r", "n", [0], 10, preemptible=False, job_id="run", expected_end=NOW + 100)]
    queue = [job("long", 1, 5, expected_seconds=200), job("short", 1, 1, expected_seconds=50)]
    predicted = policy.predict(queue, nodes, held, NOW)
    assert predicted["short"] == (NOW + 100, NOW + 150)
    assert predicted["long"] == (NOW + 150, NOW + 350)
    assert predicted["run"] == (NOW - 10 * MIN, NOW + 100)
    fifo = policy.predict(queue, nodes, held, NOW, policy="fifo")
    assert fifo["long"] == (NOW + 100, NOW + 300)


def test_predict_gives_infinity_to_jobs_waiting_on_devices_that_never_free():
    nodes = [node("n", 1, free=())]
    held = [running("r", "n", [0], 10, preemptible=False)]
    assert policy.predict([job("a", 1, 1)], nodes, held, NOW)["a"] == (float("inf"), float("inf"))
