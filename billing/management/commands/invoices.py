"""Issue the month's invoices: one per team with usage in the month, numbered per team and
year. Idempotent: a team already invoiced for the month is skipped.

    manage.py invoices --month 2026-11
    manage.py invoices --credit-note INVOICE_ID --reason "..."
"""

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from billing import invoice_service, statements
from billing.models import Invoice

ACTOR = "manage.py invoices"  # who issued them, in the audit log


class Command(BaseCommand):
    help = "Issue the invoices of a month that is over (one per team with usage), or a credit note correcting one."

    def add_arguments(self, parser):
        parser.add_argument("--month", help="YYYY-MM: a month that is over")
        parser.add_argument("--credit-note", metavar="INVOICE_ID", help="issue a credit note reversing this issued invoice")
        parser.add_argument("--reason", default="", help="why (for a credit note)")

    def handle(self, *args, month=None, credit_note=None, reason="", **options):
        if credit_note:
            try:
                original = Invoice.objects.get(pk=credit_note)
                note = invoice_service.credit_note(original, reason, actor=ACTOR)
            except (Invoice.DoesNotExist, ValueError) as error:
                raise CommandError(f"No such invoice: {credit_note}") from error
            except invoice_service.NotInvoiceable as error:
                raise CommandError(str(error)) from error
            self.stdout.write(f"credit note {note.number} for {note.team_name}: {note.total} {note.currency} (corrects {original.number})")
            return
        if not month:
            raise CommandError("Give --month YYYY-MM (or --credit-note INVOICE_ID --reason TEXT).")
        try:
            year, number = statements.parse_month(month, timezone.now())
        except ValueError as error:
            raise CommandError(str(error)) from error

        def report(invoice):
            self.stdout.write(f"{invoice.number} {invoice.team_name} {invoice.month}: {invoice.total} {invoice.currency}")

        try:
            made = invoice_service.invoice_month(year, number, on_invoice=report, actor=ACTOR)
        except invoice_service.NotInvoiceable as error:
            raise CommandError(str(error)) from error
        self.stdout.write(f"{len(made)} invoice(s) issued for {year:04d}-{number:02d}")
