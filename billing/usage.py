"""A team's month of usage records, and the statement they make (billing.statements): the
usage page, its CSV and the API's usage endpoint show it."""

from billing import statements
from billing.models import UsageRecord


def month_records(team, year, month):
    start, _end = statements.month_bounds(year, month)
    return UsageRecord.objects.filter(team=team, period=start.date()).select_related("job").prefetch_related("credits")


def month_usage(team, year, month, records=None):
    records = month_records(team, year, month) if records is None else records
    return statements.statement(
        statements.Usage(
            job_id=str(r.job_id),
            job_name=r.job.name,
            gpus=r.gpus,
            gpu_type=r.gpu_type,
            held_seconds=r.held_seconds,
            rate=r.rate,
            amount=r.amount,
            credit_seconds=r.credit_seconds,
            credit_amount=r.credit_amount,
        )
        for r in records
    )
