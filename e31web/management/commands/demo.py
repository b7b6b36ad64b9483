from django.core.management.base import BaseCommand

from e31web import demo


class Command(BaseCommand):
    help = "Create the demo team, user, operator, digits dataset and (if none) a first rate."

    def handle(self, *args, **options):
        made = demo.seed()
        self.stdout.write(f"demo team {made['team'].name!r}: log in as {demo.DEMO_USER[0]} / {demo.DEMO_USER[1]}")
        self.stdout.write(f"operator (admin): {demo.OPERATOR[0]} / {demo.OPERATOR[1]}")
        if made["rate"] is not None:
            self.stdout.write(f"first rate set: {made['rate'].per_gpu_hour} per GPU-hour (change it in the admin)")
