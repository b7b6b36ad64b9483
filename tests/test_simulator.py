"""The trace simulator (scheduler.simulator) and the `simulate` command: no database."""

import json
import math
from collections import Counter
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from scheduler import simulator as S
from scheduler.policy import NodeState

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def two_jobs():
    """On one node of 2 devices: A (2 devices, 100 s) at 0, B (1 device, 50 s) at 10 waits for A."""
    return [
        S.TraceJob("A", submit=0, gpus=2, duration=100, deadline=100, team="t0"),
        S.TraceJob("B", submit=10, gpus=1, duration=50, deadline=120, team="t1"),
    ]


def test_metrics_arithmetic_on_a_tiny_trace():
    result = S.simulate(two_jobs(), [NodeState("n", "gpu", 2, (0, 1))], "fifo")
    assert result.stuck == []
    assert [(result.outcomes[j].first_start, result.outcomes[j].finish) for j in "AB"] == [(0, 100), (100, 150)]
    m = S.metrics(result)
    assert m["mean_jct"] == 120 and m["median_jct"] == 120 and m["p99_jct"] == 140
    assert m["mean_wait"] == 45 and m["p99_wait"] == 90
    assert m["mean_bounded_slowdown"] == pytest.approx((1 + 140 / 50) / 2)
    assert m["makespan"] == 150
    assert m["utilization"] == pytest.approx((2 * 100 + 1 * 50) / (2 * 150))
    assert m["deadline_satisfaction"] == 0.5  # A by 100, B at 150 after 120
    assert m["jain_teams"] == pytest.approx((1 + 2.8) ** 2 / (2 * (1 + 2.8**2)))
    assert math.isnan(m["longest_wait_16plus"])


def test_bounded_slowdown_counts_short_jobs_as_ten_seconds():
    jobs = [S.TraceJob("A", 0, 1, 100), S.TraceJob("B", 0, 1, 2)]
    m = S.metrics(S.simulate(jobs, [NodeState("n", "gpu", 1, (0,))], "fifo"))
    # A first (by id at the same time), B waits 100 s then runs 2 s: JCT 102, over max(2, 10).
    assert m["mean_bounded_slowdown"] == pytest.approx((1 + 102 / 10) / 2)


def test_jain_index():
    assert S.jain([1, 1, 1]) == 1.0
    assert S.jain([1, 0, 0, 0]) == 0.25


def test_the_policy_sees_estimates_and_the_true_duration_decides_the_end():
    job = S.TraceJob("A", 0, 1, duration=100, estimate=500)
    result = S.simulate([job], [NodeState("n", "gpu", 1, (0,))], "ours")
    assert result.outcomes["A"].finish == 100


def test_a_job_running_past_its_estimate_is_extended_and_a_large_one_gets_whole_nodes():
    jobs = [S.TraceJob("over", 0, 8, duration=500, estimate=100), S.TraceJob("gang", 1, 16, duration=10)]
    result = S.simulate(jobs, S.make_nodes(16, 8), "easy")
    assert result.outcomes["over"].finish == 500
    assert result.outcomes["gang"].first_start == 500
    assert len(result.outcomes["gang"].runs[0][2]) == 2  # two nodes


def test_prepare_is_seeded_and_documents_its_noise():
    rows = [{"job_id": f"j{i}", "submit_time_s": float(i), "num_gpus": 1, "duration_s": 1000.0, "deadline_s": i + 1200.0} for i in range(200)]
    a, b = S.prepare(rows, seed=3), S.prepare(rows, seed=3)
    assert [(j.estimate, j.team) for j in a] == [(j.estimate, j.team) for j in b]
    assert all(j.estimate >= j.duration for j in a)
    assert 1.2 < sorted(j.estimate / j.duration for j in a)[100] < 1.8  # median about 1.5
    assert {j.team for j in a} <= {f"team{k}" for k in range(8)} and len({j.team for j in a}) == 8
    assert [j.deadline for j in a] == [r["deadline_s"] for r in rows]
    stretched = S.prepare(rows, seed=3, deadlines="stretched")
    assert all(1.5 * 1000 <= j.deadline - j.submit <= 3 * 1000 for j in stretched)
    assert [j.estimate for j in stretched] == [j.estimate for j in a]  # same noise whatever the deadlines


def test_teams_come_from_the_trace_or_are_drawn_with_a_few_heavy_ones():
    rows = [{"job_id": f"j{i}", "submit_time_s": float(i), "num_gpus": 1, "duration_s": 100.0} for i in range(4000)]
    shares = Counter(j.team for j in S.prepare(rows, seed=1))
    assert 0.45 < shares["team0"] / 4000 < 0.58  # the largest submits about half
    assert shares["team0"] > shares["team1"] > shares["team2"] > shares["team7"] > 0.01 * 4000
    even = Counter(j.team for j in S.prepare(rows, seed=1, skew=0))
    assert max(even.values()) / min(even.values()) < 1.3  # skew 0: the old equal hashing
    named = S.prepare([{**rows[0], "team": "vision"}, rows[1]], seed=1)
    assert named[0].team == "vision" and named[1].team.startswith("team")


def test_a_trace_s_team_column_is_read_and_fairness_is_reported_per_team(tmp_path):
    path = tmp_path / "teams.csv"
    path.write_text("job_id,submit_time_s,num_gpus,duration_s,team\na,0,2,100,heavy\nb,0,2,100,heavy\nc,0,2,100,light\n")
    jobs = S.prepare(S.read_trace(path))
    assert [j.team for j in jobs] == ["heavy", "heavy", "light"]
    m = S.metrics(S.simulate(jobs, S.make_nodes(2, 2), "fifo"))
    assert list(m["teams"]) == ["heavy", "light"]  # the largest first
    assert m["teams"]["heavy"]["jobs"] == 2 and m["teams"]["heavy"]["gpu_hour_share"] == pytest.approx(2 / 3)
    assert m["teams"]["light"]["mean_bounded_slowdown"] == pytest.approx(3.0)  # waited 200 s for a 100 s job
    text = "\n".join(S.describe(m))
    assert "heavy: 2 jobs, mean bounded slowdown 1.50, 66.7% of the GPU-hours (entitled to 50.0%)" in text


@pytest.fixture
def tiny_trace(tmp_path):
    path = tmp_path / "tiny.csv"
    path.write_text("job_id,submit_time_s,num_gpus,duration_s,deadline_s\na,0,8,3600,7200\nb,10,16,600,2000\nc,20,1,60,100\nd,30,2,7200,20000\n")
    return path


def test_the_command_prints_the_metrics(tiny_trace):
    out = StringIO()
    call_command("simulate", trace=str(tiny_trace), gpus=16, gpus_per_node=8, policy="ours", stdout=out)
    text = out.getvalue()
    assert "4 jobs on 16 GPUs (8 per node), deadlines: trace" in text
    for words in (
        "JCT: mean",
        "queueing delay: mean",
        "bounded slowdown",
        "makespan",
        "utilization",
        "deadline satisfaction",
        "Jain's index over teams",
        "longest wait of a job of 16+ GPUs",
        "estimates / true durations: median",
    ):
        assert words in text


def test_the_command_prints_json_and_a_table_of_all_policies(tiny_trace):
    out = StringIO()
    call_command("simulate", trace=str(tiny_trace), gpus=16, policy="easy", json=True, deadlines="stretched", seed=4, stdout=out)
    data = json.loads(out.getvalue())
    assert data["policy"] == "easy" and data["deadlines"] == "stretched" and data["seed"] == 4
    assert data["finished"] == 4 and data["makespan"] > 0 and 0 < data["utilization"] <= 1
    out = StringIO()
    call_command("simulate", trace=str(tiny_trace), gpus=16, policy="all", stdout=out)
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["fifo", "sjf", "easy", "sjf-easy", "edf", "ours", "oracle"]


@pytest.mark.skipif(not (TRACES / "itp_cluster10.csv").exists(), reason="shared/traces is not beside the repository")
def test_the_small_real_trace_runs_to_the_end_with_every_policy():
    rows = S.read_trace(TRACES / "itp_cluster10.csv")
    assert len(rows) == 260 and rows[0]["job_id"]
    jobs = S.prepare(rows)
    for name in S.NAMES:
        result = S.simulate(jobs, S.make_nodes(32, 8), name)
        m = S.metrics(result)
        assert result.stuck == [] and m["finished"] == 260, name
        assert 0 < m["utilization"] < 1 and 0 <= m["deadline_satisfaction"] <= 1 and 0 < m["jain_teams"] <= 1


def test_the_oracle_is_shortest_first_with_easy_told_the_true_durations():
    # One GPU; "long" runs 500 s and says 600, "short" runs 100 s and says 1000 (an over-estimate).
    jobs = [S.TraceJob("long", 0, 1, 500, estimate=600), S.TraceJob("short", 0, 1, 100, estimate=1000)]
    nodes = S.make_nodes(1, 1)
    told = S.simulate(jobs, nodes, "sjf-easy").outcomes
    oracle = S.simulate(jobs, nodes, "oracle").outcomes
    assert told["long"].first_start == 0 and told["short"].first_start == 500  # the estimates mislead it
    assert oracle["short"].first_start == 0 and oracle["long"].first_start == 100  # the truth does not
    assert jobs[1].estimate == 1000  # the caller's jobs are left as they were


def test_sjf_easy_reserves_for_the_shortest_blocked_job_where_sjf_does_not():
    # 2 GPUs, one held until 100 s. "pair" (2 GPUs, shortest) is blocked; "solo" (1 GPU, 1000 s)
    # would run on the free GPU past 100 s and delay it: sjf lets it, sjf-easy holds it back.
    jobs = [S.TraceJob("hold", 0, 1, 100), S.TraceJob("pair", 1, 2, 200), S.TraceJob("solo", 2, 1, 1000)]
    nodes = S.make_nodes(2, 2)
    assert S.simulate(jobs, nodes, "sjf").outcomes["solo"].first_start == 2
    easy = S.simulate(jobs, nodes, "sjf-easy").outcomes
    assert easy["pair"].first_start == 100 and easy["solo"].first_start >= 300


def test_a_malformed_trace_is_refused_with_the_column_or_line(tmp_path):
    missing = tmp_path / "missing.csv"
    missing.write_text("job_id,submit_time_s\nx,1\n")
    with pytest.raises(CommandError, match="missing column\\(s\\) num_gpus, duration_s"):
        call_command("simulate", "--trace", str(missing), "--gpus", "8", "--gpus-per-node", "8")
    bad = tmp_path / "bad.csv"
    bad.write_text("job_id,submit_time_s,num_gpus,duration_s\nx,1,two,5\n")
    with pytest.raises(CommandError, match="line 2: invalid literal"):
        call_command("simulate", "--trace", str(bad), "--gpus", "8", "--gpus-per-node", "8")


def test_ours_is_told_what_the_finished_jobs_of_its_team_and_size_held_and_nothing_from_the_future():
    # One GPU. A and B (team t, 100 s, estimated 1000 s) run one after the other; C and D come
    # after both ended, E (team u) too; B came before anything ended. scheduler.services' rule:
    # min(the estimate, the learned duration), learned when the job is first queued.
    jobs = [
        S.TraceJob("A", 0, 1, 100, estimate=1000, team="t"),
        S.TraceJob("B", 1, 1, 100, estimate=1000, team="t"),
        S.TraceJob("C", 250, 1, 100, estimate=1000, team="t"),
        S.TraceJob("D", 260, 1, 100, estimate=50, team="t"),
        S.TraceJob("E", 270, 1, 100, estimate=1000, team="u"),
    ]
    nodes = S.make_nodes(1, 1)
    told = {j: o.told for j, o in S.simulate(jobs, nodes, "ours").outcomes.items()}
    assert told == {"A": 1000, "B": 1000, "C": 100, "D": 60, "E": 1000}  # D: its own 50 s, a minute at least
    assert {o.told for o in S.simulate(jobs, nodes, "ours", learn=False).outcomes.values()} == {1000, 50}
    assert {o.told for o in S.simulate(jobs, nodes, "easy").outcomes.values()} == {1000, 50}  # baselines read estimates
    assert S.simulate(jobs, nodes, "easy", learn=True).outcomes["C"].told == 100
    m = S.metrics(S.simulate(jobs, nodes, "ours"))
    assert m["estimate_accuracy"] == (pytest.approx(10.0), pytest.approx(10.0))  # 1000/100 three times, 1.0 and 0.6
    jobs[1] = S.TraceJob("B", 1, 1, 900, estimate=1000, team="t")  # A's 100 s and B's 900 s disagree: nothing learned
    assert S.simulate(jobs, nodes, "ours").outcomes["C"].told == 1000


def test_the_command_can_leave_learning_out(tiny_trace):
    out = StringIO()
    call_command("simulate", trace=str(tiny_trace), gpus=16, json=True, no_learning=True, stdout=out)
    assert json.loads(out.getvalue())["learning"] is False


def test_a_running_job_is_expected_to_end_at_its_limit_not_its_learned_duration(monkeypatch):
    # As production's scheduler sees allocations (scheduler.allocations.running_allocations).
    # Two GPUs; learned from A and B, C is told 100 s, but it runs 300 s; its declared 1,000 s is its
    # limit. Expected to end at its learned end, it was "past its expected end" after 100 s and
    # taken to end at every pass, and a reservation sat on its device "from now" for 200 s.
    jobs = [
        S.TraceJob("A", 0, 1, 100, estimate=1000, team="t"),
        S.TraceJob("B", 1, 1, 100, estimate=1000, team="t"),
        S.TraceJob("C", 250, 1, 300, estimate=1000, team="t"),
        S.TraceJob("D", 400, 2, 50, estimate=50, team="u"),  # both GPUs: it waits for C
    ]
    seen, plan = [], S.P.plan

    def watch(queue, nodes, running, now, **kwargs):
        seen.extend((now, r.job_id, r.expected_end - r.started_at) for r in running)
        return plan(queue, nodes, running, now, **kwargs)

    monkeypatch.setattr(S.P, "plan", watch)
    result = S.simulate(jobs, S.make_nodes(2, 2), "ours")
    assert result.outcomes["C"].told == 100
    assert (400, "C", 1000) in seen  # D arrives while C runs: C's limit, not its 100 s
    assert result.outcomes["D"].first_start == 550
