"""`e31 sweep ...`: start a sweep from a file's `sweep:` section, list the team's sweeps, show one
with its trials, and run its best configuration again.

A sweep file (YAML or JSON):

    sweep:
      name: lr-width
      template: 0f5c2b4e          # a job of the team's (its id or the start of one): each trial copies it
      space:
        lr: {type: float, low: 0.0001, high: 0.1, log: true}
        width: {type: choice, choices: [64, 128, 256]}
      method: tpe                 # grid, random or tpe (model-based)
      objective: val_loss         # the metric the trials log (e31.log_metric)
      direction: min
      max_trials: 16
      parallel: 2
      ceiling: 5.00               # the most the whole sweep may cost
      prune: true                 # stop trials that fall behind
"""

import argparse
import re
from pathlib import Path
from typing import Any

import yaml

from e31.cli import ui
from e31.cli.client import FULL_ID, Client
from e31.cli.errors import NOT_FOUND, OK, USAGE, CliError
from e31.cli.spec import assignments

FIELDS = ("name", "template", "space", "method", "objective", "direction", "max_trials", "parallel", "ceiling", "seed", "prune")
REQUIRED = ("name", "template", "space", "method", "objective", "max_trials", "ceiling")


def read_sweep(path_text: str) -> dict[str, Any]:
    """The `sweep:` section of a file, checked for what the API cannot say about a file (its
    name and lines): unknown keys and missing ones."""
    path = Path(path_text)
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"{path_text} does not exist.", USAGE) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise CliError(f"Cannot read {path_text}: {error}", USAGE) from None
    section = loaded.get("sweep") if isinstance(loaded, dict) else None
    if not isinstance(section, dict):
        raise CliError(f"{path_text}: no `sweep:` section (a mapping of {', '.join(REQUIRED)} ...).", USAGE)
    unknown = sorted(set(section) - set(FIELDS))
    if unknown:
        raise CliError(f"{path_text}: sweep has no field {', '.join(unknown)} (it takes {', '.join(FIELDS)}).", USAGE)
    missing = [f for f in REQUIRED if f not in section]
    if missing:
        raise CliError(f"{path_text}: sweep needs {', '.join(missing)}.", USAGE)
    return {**section, "ceiling": str(section["ceiling"])}


def resolve_sweep(client: Client, ref: str) -> str:
    """A sweep's full id from its id or a unique start of it."""
    ref = ref.strip().lower()
    if FULL_ID.match(ref):
        return ref
    if not re.fullmatch(r"[0-9a-f-]{1,36}", ref):
        raise CliError(f"{ref!r} is not a sweep id (or the start of one).", USAGE)
    found = [s for s in client.pages("/api/sweeps/", limit=1000) if str(s.get("id", "")).startswith(ref)]
    if not found:
        raise CliError(f"No sweep's id starts with {ref}.", NOT_FOUND)
    if len(found) > 1:
        raise CliError(f"{len(found)} sweeps' ids start with {ref}: give more of the id.", USAGE)
    return str(found[0]["id"])


def value(trial: dict[str, Any] | None) -> str:
    return "" if not trial or trial.get("value") is None else f"{trial['value']:.6g}"


def show_sweep(sweep: dict[str, Any]) -> None:
    best = sweep.get("best")
    ui.print_fields(
        [
            ("id", sweep.get("id")),
            ("name", sweep.get("name")),
            ("state", sweep.get("state")),
            ("reason", sweep.get("reason") or None),
            (
                "search",
                f"{sweep.get('method')}, {sweep.get('objective')} ({sweep.get('direction')}), {sweep.get('max_trials')} trials, {sweep.get('parallel')} at once",
            ),
            ("spent", f"{sweep.get('spent')} of {sweep.get('ceiling')} {sweep.get('currency')} (committed {sweep.get('committed')})"),
            ("best", f"trial {best['number']}: {value(best)} {best['params']}" if best else None),
        ]
    )
    trials = sweep.get("trials") or []
    if trials:
        names = sorted({name for t in trials for name in t.get("params", {})})
        ui.print_table(
            ["#", *names, "state", sweep.get("objective") or "objective", "held s", "cost", "job"],
            [(t["number"], *(t["params"].get(n, "") for n in names), t["state"], value(t), t["held_seconds"], t["cost"], str(t["job"])[:8]) for t in trials],
        )


def cmd_sweep_start(args: argparse.Namespace, client: Client) -> int:
    body = read_sweep(args.file)
    if args.template:
        body["template"] = args.template
    body["template"] = client.resolve_job(str(body["template"]))
    sweep = client.post("/api/sweeps/", json=body, ok=(201,))
    if args.json:
        ui.print_json(sweep)
    else:
        print(f"Started sweep {sweep['name']} ({sweep['id'][:8]}): its first trials queue at the scheduler's next turn.")
    return OK


def cmd_sweep_list(args: argparse.Namespace, client: Client) -> int:
    found = client.pages("/api/sweeps/", limit=args.limit)
    if args.json:
        ui.print_json(found)
        return OK
    if not found:
        print("No sweeps yet.")
        return OK
    ui.print_table(
        ["id", "name", "state", "objective", "best", "spent", "ceiling"],
        [(str(s["id"])[:8], s["name"], s["state"], s["objective"], value(s.get("best")), s["spent"], f"{s['ceiling']} {s['currency']}") for s in found],
    )
    return OK


def cmd_sweep_show(args: argparse.Namespace, client: Client) -> int:
    sweep = client.get(f"/api/sweeps/{resolve_sweep(client, args.sweep)}/")
    if args.json:
        ui.print_json(sweep)
    else:
        show_sweep(sweep)
    return OK


def cmd_sweep_rerun(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = {"config": assignments(args.set, "--set"), "hyperparameters": assignments(args.hp, "--hp")}
    if args.name:
        body["name"] = args.name
    queued = client.post(f"/api/sweeps/{resolve_sweep(client, args.sweep)}/rerun/", json=body, ok=(201,))
    job = client.job(str(queued["job"]))
    if args.json:
        ui.print_json(job)
    else:
        print(f"Queued {job['name']} ({job['id'][:8]}): the best configuration again. Follow it with `e31 logs -f {job['id'][:8]}`.")
    return OK


def add_commands(commands: Any, common: argparse.ArgumentParser, parser_class: type, connected: Any) -> None:
    """The `sweep` command and its subcommands; connected(f) gives f a client."""
    sweep = commands.add_parser("sweep", help="start, list and follow sweeps over a job's parameters")
    sub = sweep.add_subparsers(dest="sweep_command", metavar="COMMAND", parser_class=parser_class)
    sub.required = True
    p = sub.add_parser("start", parents=[common], help="start a sweep from a file's `sweep:` section")
    p.add_argument("file")
    p.add_argument("--template", help="the template job (its id or the start of one), instead of the file's")
    p.set_defaults(func=connected(cmd_sweep_start))
    p = sub.add_parser("list", parents=[common], help="your team's sweeps")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=connected(cmd_sweep_list))
    p = sub.add_parser("show", parents=[common], help="a sweep with its trials, the best so far and its spend")
    p.add_argument("sweep", help="a sweep id or the start of one")
    p.set_defaults(func=connected(cmd_sweep_show))
    p = sub.add_parser("rerun", parents=[common], help="run a sweep's best configuration again as a job of its own")
    p.add_argument("sweep")
    p.add_argument("--name")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="change a key of the config (repeatable), e.g. --set max_steps=5000")
    p.add_argument("--hp", action="append", metavar="NAME=VALUE", help="change a hyperparameter (repeatable)")
    p.set_defaults(func=connected(cmd_sweep_rerun))
