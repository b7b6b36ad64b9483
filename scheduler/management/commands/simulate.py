import json

from django.core.management.base import BaseCommand, CommandError

from scheduler import simulator


class Command(BaseCommand):
    help = (
        "Replay a job trace (CSV: job_id, submit_time_s, num_gpus, duration_s, deadline_s) through the "
        "scheduling policy with a simulated clock and print JCT, waits, slowdown, utilization, deadlines and fairness."
    )

    def add_arguments(self, parser):
        parser.add_argument("--trace", required=True, help="the trace CSV file")
        parser.add_argument("--gpus", type=int, default=128, help="GPUs in the simulated pool (default 128)")
        parser.add_argument("--gpus-per-node", type=int, default=8)
        parser.add_argument("--policy", default="ours", choices=[*simulator.NAMES, "all"])
        parser.add_argument("--seed", type=int, default=0, help="teams, estimate noise and stretched deadlines (default 0)")
        parser.add_argument(
            "--deadlines",
            default="trace",
            choices=["trace", "stretched"],
            help="the trace's own deadlines (about half infeasible) or submit + duration x U(1.5, 3)",
        )
        parser.add_argument("--teams", type=int, default=8)
        parser.add_argument(
            "--no-learning",
            action="store_true",
            help="ours told the users' estimates alone, not min(estimate, the duration learned from the finished jobs of its team and size)",
        )
        parser.add_argument("--json", action="store_true", help="print the metrics as JSON")

    def handle(self, *args, **options):
        trace, gpus, gpus_per_node = options["trace"], options["gpus"], options["gpus_per_node"]
        seed, deadlines, teams = options["seed"], options["deadlines"], options["teams"]
        if gpus < 1 or gpus_per_node < 1:
            raise CommandError("--gpus and --gpus-per-node must be at least 1")
        try:
            rows = simulator.read_trace(trace)
        except (OSError, KeyError, ValueError) as error:
            raise CommandError(f"cannot read the trace {trace}: {error}") from error
        jobs = simulator.prepare(rows, seed=seed, teams=teams, deadlines=deadlines)
        names = list(policy_names(options["policy"]))
        nodes = simulator.make_nodes(gpus, gpus_per_node)
        learn = False if options["no_learning"] else None
        results = {name: simulator.metrics(simulator.simulate(jobs, nodes, name, learn=learn)) for name in names}
        setting = {
            "trace": trace,
            "gpus": gpus,
            "gpus_per_node": gpus_per_node,
            "seed": seed,
            "deadlines": deadlines,
            "teams": teams,
            "learning": not options["no_learning"],
        }
        if options["json"]:
            out = {**setting, "policies": results} if len(names) > 1 else {**setting, "policy": names[0], **results[names[0]]}
            self.stdout.write(dumps(out))
            return
        self.stdout.write(f"{trace}: {len(jobs)} jobs on {gpus} GPUs ({gpus_per_node} per node), deadlines: {deadlines}, seed {seed}, {teams} teams")
        if len(names) > 1:
            for line in simulator.table([(name, results[name]) for name in names]):
                self.stdout.write(line)
            return
        self.stdout.write(f"policy: {names[0]}")
        for line in simulator.describe(results[names[0]]):
            self.stdout.write(f"  {line}")


def policy_names(name):
    return simulator.NAMES if name == "all" else (name,)


def dumps(value):
    """JSON with NaN (a figure with no data, e.g. no job of 16+ GPUs) as null."""

    def clean(v):
        if isinstance(v, float) and v != v:
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return json.dumps(clean(value), indent=2, sort_keys=True)
