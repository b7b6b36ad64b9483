from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing import meter
from billing.statements import Usage, month_bounds, parse_month, statement

T0 = datetime(2026, 12, 1, 22, 0, tzinfo=UTC)


def test_held_seconds_counts_whole_seconds():
    assert meter.held_seconds(T0, T0 + timedelta(seconds=59, microseconds=999_999)) == 59
    assert meter.held_seconds(T0, T0 + timedelta(hours=2)) == 7200


def test_held_seconds_is_never_negative():
    assert meter.held_seconds(T0, T0 - timedelta(seconds=5)) == 0


def test_charge_is_gpus_times_seconds_times_rate():
    assert meter.charge(2, 3600, Decimal("2.50")) == Decimal("5.00")
    assert meter.charge(1, 1, Decimal("3.60")) == Decimal("0.001")
    assert meter.charge(8, 7, Decimal("2.50")) == Decimal("0.03888889")  # 8 x 7 x 2.5 / 3600, half-even at 1e-8


def test_charge_never_passes_its_cap():
    assert meter.charge(4, 36000, Decimal("2"), cap=Decimal("10")) == Decimal("10")
    assert meter.charge(1, 36, Decimal("2"), cap=Decimal("10")) == Decimal("0.02")


def test_money_is_rounded_half_even_to_cents():
    assert meter.round_money(Decimal("0.125")) == Decimal("0.12")
    assert meter.round_money(Decimal("0.135")) == Decimal("0.14")


def test_a_money_ceiling_buys_whole_seconds():
    # 10.00 at 2.50 per GPU-hour on 2 GPUs: 2 hours.
    request = meter.Request(gpus=2, ceiling_amount=Decimal("10.00"))
    assert meter.held_limit_seconds(request, Decimal("2.50")) == 7200
    assert meter.charge(2, 7200, Decimal("2.50")) <= Decimal("10.00")


def test_a_money_ceiling_is_never_exceeded_by_its_limit():
    for amount in ("0.01", "1.00", "3.33", "97.13"):
        for rate in ("0.70", "2.50", "3.1416"):
            for gpus in (1, 3, 8):
                request = meter.Request(gpus=gpus, ceiling_amount=Decimal(amount))
                seconds = meter.held_limit_seconds(request, Decimal(rate))
                assert meter.charge(gpus, seconds, Decimal(rate)) <= Decimal(amount)
                # ... and it is the most: one more second would pass the ceiling.
                assert meter.charge(gpus, seconds + 1, Decimal(rate)) > Decimal(amount)


def test_a_gpu_hour_ceiling_is_spread_over_the_gpus():
    request = meter.Request(gpus=4, ceiling_gpu_hours=Decimal("2"))
    assert meter.held_limit_seconds(request, Decimal("1")) == 1800


def test_the_span_limits_held_time():
    assert meter.held_limit_seconds(meter.Request(gpus=1, span_hours=Decimal("0.5")), Decimal("9")) == 1800


def test_no_span_no_ceiling_is_unbounded():
    assert meter.held_limit_seconds(meter.Request(gpus=1), Decimal("1")) is None


def test_the_estimate_of_a_span_is_gpus_hours_rate():
    estimate = meter.estimate(meter.Request(gpus=2, span_hours=Decimal("3")), Decimal("2.50"))
    assert estimate.amount == Decimal("15.00") and estimate.gpu_hours == 6


def test_the_estimate_of_until_done_is_the_ceiling():
    estimate = meter.estimate(meter.Request(gpus=2, ceiling_amount=Decimal("40")), Decimal("2.50"))
    assert estimate.amount == Decimal("40") and estimate.hours == 8
    estimate = meter.estimate(meter.Request(gpus=2, ceiling_gpu_hours=Decimal("10")), Decimal("2.50"))
    assert estimate.amount == Decimal("25.00") and estimate.hours == 5


def test_the_cost_cap_of_a_gpu_hour_ceiling_is_its_price():
    assert meter.cost_cap(meter.Request(gpus=1, ceiling_gpu_hours=Decimal("2")), Decimal("3")) == Decimal("6")
    assert meter.cost_cap(meter.Request(gpus=1, span_hours=Decimal("2")), Decimal("3")) is None


def test_a_statement_rounds_each_line_once_and_sums_the_lines():
    usages = [
        Usage("a", "first", 1, "cpu", 7, Decimal("2.5"), Decimal("0.00486111")),
        Usage("a", "first", 1, "cpu", 5, Decimal("2.5"), Decimal("0.00347222")),  # requeued: same job, second allocation
        Usage("b", "second", 2, "cpu", 3600, Decimal("2.5"), Decimal("5.00000000")),
        Usage("c", "third", 1, "cpu", 10, Decimal("0.45"), Decimal("0.00125")),
    ]
    result = statement(usages)
    assert [line.job_id for line in result.lines] == ["a", "b", "c"]
    assert result.lines[0].held_seconds == 12 and result.lines[0].amount == Decimal("0.01")
    assert result.lines[1].gpu_seconds == 7200
    assert result.total == Decimal("5.01") == sum(line.amount for line in result.lines)


def test_months_are_parsed_strictly():
    assert parse_month("2026-02", T0) == (2026, 2)
    assert parse_month("", T0) == (2026, 12)
    for bad in ("2026-13", "26-01", "2026/01", "soon"):
        with pytest.raises(ValueError):
            parse_month(bad, T0)


def test_december_ends_at_new_year():
    start, end = month_bounds(2026, 12)
    assert (start.month, end.year, end.month) == (12, 2027, 1)


def test_the_credit_for_lost_time_runs_from_the_last_checkpoint():
    start = datetime(2026, 12, 2, 22, 0, tzinfo=UTC)
    end = start + timedelta(seconds=600)
    rate = Decimal("3.60")  # 0.001 per GPU-second
    charged = meter.charge(2, 600, rate)
    assert meter.lost_time_credit(2, rate, start, end, start + timedelta(seconds=400), charged) == (200, Decimal("0.4"))
    # No checkpoint in this allocation (or only an earlier allocation's): all of it is lost.
    assert meter.lost_time_credit(2, rate, start, end, None, charged) == (600, charged)
    assert meter.lost_time_credit(2, rate, start, end, start - timedelta(hours=1), charged) == (600, charged)
    # A checkpoint at the very end: nothing lost. Never more than was charged (a capped bill).
    assert meter.lost_time_credit(2, rate, start, end, end, charged) == (0, Decimal("0"))
    assert meter.lost_time_credit(2, rate, start, end, None, Decimal("0.25")) == (600, Decimal("0.25"))


from hypothesis import given  # noqa: E402
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st


@hypothesis_settings(max_examples=300, deadline=None)
@given(
    gpus=st.integers(1, 64),
    ceiling=st.decimals(min_value=Decimal("0.01"), max_value=Decimal("5000"), places=2),
    runs=st.lists(
        st.tuples(
            st.decimals(min_value=Decimal("0.01"), max_value=Decimal("99"), places=4),  # the rate of this allocation
            st.integers(0, 10**7),  # how long the process would have held it
            st.floats(0, 1),  # the share of it lost through the network's fault, credited
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_no_job_is_ever_billed_past_its_money_ceiling(gpus, ceiling, runs):
    """Over any run of allocations (requeues, rate changes, credits), what the job is billed
    stays within its ceiling: each allocation gets only what is left, the runner releases it
    at its limit, and each charge is capped."""
    request = meter.Request(gpus=gpus, ceiling_amount=ceiling)
    held, billed = 0, Decimal(0)
    for rate, wanted, lost in runs:
        limit, cap = meter.remaining_allowance(request, rate, held, billed)
        seconds = min(wanted, limit)  # the runner releases at the limit
        amount = meter.charge(gpus, seconds, rate, cap=cap)
        credit_seconds = int(seconds * lost)
        credit = min(meter.charge(gpus, credit_seconds, rate), amount)
        held += seconds - credit_seconds
        billed += amount - credit
        assert amount <= cap
    assert billed <= ceiling


def _line_summed(job_id, items):
    """A statement line as the sums over a job's records make it (statement's general case)."""
    return (
        job_id,
        items[0].job_name,
        max(u.gpus for u in items),
        ", ".join(sorted({u.gpu_type for u in items})),
        sum(u.held_seconds for u in items),
        sum(u.held_seconds * u.gpus for u in items),
        tuple(sorted({u.rate for u in items})),
        meter.round_money(sum((u.amount for u in items), Decimal(0))),
        sum(u.credit_seconds for u in items),
        meter.round_money(sum((u.credit_amount for u in items), Decimal(0))),
    )


@hypothesis_settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d", "e"]),  # the job: some have one record, some several
            st.integers(1, 8),
            st.sampled_from(["a100", "h100", "cpu"]),
            st.integers(0, 10**6),
            st.decimals(min_value=Decimal("0.01"), max_value=Decimal("99"), places=4),
            st.decimals(min_value=Decimal("0"), max_value=Decimal("9999"), places=6),
            st.integers(0, 1000),
            st.decimals(min_value=Decimal("0"), max_value=Decimal("99"), places=6),
        ),
        max_size=12,
    )
)
def test_a_statement_line_is_its_records_summed_whether_the_job_has_one_or_several(records):
    """A job with one record takes a shorter way to its line (most jobs of a month ran once):
    the same line as the sums make."""
    usages = [
        Usage(job_id=j, job_name=f"job {j}", gpus=g, gpu_type=t, held_seconds=s, rate=r, amount=a, credit_seconds=cs, credit_amount=ca)
        for j, g, t, s, r, a, cs, ca in records
    ]
    by_job = {}
    for usage in usages:
        by_job.setdefault(usage.job_id, []).append(usage)
    made = statement(usages)
    assert [(x.job_id, x.job_name, x.gpus, x.gpu_type, x.held_seconds, x.gpu_seconds, x.rates, x.amount, x.credit_seconds, x.credit) for x in made.lines] == [
        _line_summed(job_id, items) for job_id, items in by_job.items()
    ]
    assert made.total == sum(
        (meter.round_money(sum((u.amount for u in i), Decimal(0))) - meter.round_money(sum((u.credit_amount for u in i), Decimal(0))) for i in by_job.values()),
        Decimal("0.00"),
    )
