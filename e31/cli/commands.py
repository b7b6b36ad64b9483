"""The e31 commands: argparse, and one function per command returning the exit code.

Over 500 lines: one short function per command, side by side as `e31 --help` lists them; they share
the client, the tables and the streaming helpers."""

import argparse
import getpass
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn
from urllib.parse import quote

from e31.cli import config, sweeps, ui
from e31.cli.client import Client
from e31.cli.datasets import sha256_of
from e31.cli.errors import AUTH, INTERRUPTED, JOB_FAILED, OK, SERVER, USAGE, CliError
from e31.cli.follow import Follower, Printer, print_logs
from e31.cli.spec import assignments, check_exist, files_of, local_refs, size_of, upload_files

RETRAIN_OPTIONS = ["name", "gpus", "gpu_type", "mode", "span_hours", "ceiling_kind", "ceiling", "not_before", "by", "deadline"]


def say(text: str) -> None:
    """A note for the person at the terminal: on stderr, so stdout stays the command's output."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def connect(args: argparse.Namespace) -> Client:
    settings = config.require(getattr(args, "server", None))
    return Client(settings["server"], settings["token"])


def with_client(command: Callable[[argparse.Namespace, Client], int]) -> Callable[[argparse.Namespace], int]:
    """A command that takes a connected client, as the parser calls commands."""

    def run(args: argparse.Namespace) -> int:
        with connect(args) as client:
            return command(args, client)

    return run


def read_spec(path_text: str) -> tuple[Path, str]:
    path = Path(path_text)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"{path_text} does not exist.", USAGE) from None
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"Cannot read {path_text}: {error}", USAGE) from None
    return path, text


def short(job_id: object) -> str:
    return str(job_id or "")[:8]


def when(value: object) -> str:
    """An API timestamp as 2025-01-31 14:05."""
    if not value:
        return ""
    return str(value).replace("T", " ")[:16]


# login -------------------------------------------------------------------------------------


def cmd_login(args: argparse.Namespace) -> int:
    stored = config.read_file()
    server = args.server or os.environ.get("E31_SERVER") or stored.get("server")
    if not server:
        server = input(f"Server [{config.DEFAULT_SERVER}]: ").strip() or config.DEFAULT_SERVER
    server = server.rstrip("/")
    token = args.token
    if not token:
        username = args.username or input("Username: ").strip()
        # --password-stdin: for scripts, which have no terminal to type it at (as `docker login`).
        password = sys.stdin.readline().rstrip("\n") if args.password_stdin else getpass.getpass("Password: ")
        with Client(server) as anonymous:
            try:
                body = anonymous.post("/api/token/", json={"username": username, "password": password})
            except CliError as error:
                if error.status == 400:  # wrong username or password
                    error.code = AUTH
                raise
        token = body.get("token")
        if not token:
            raise CliError("The server sent no token.", SERVER)
    with Client(server, token) as client:
        me = client.get("/api/me/")
    path = config.save(server, token)
    team = me.get("team")
    team_name = team.get("name") if isinstance(team, dict) else team
    result = {"server": server, "username": me.get("username"), "team": team_name, "config": str(path)}
    if args.json:
        ui.print_json(result)
    else:
        team = f" (team {team_name})" if team_name else ""
        print(f"Logged in to {server} as {me.get('username')}{team}. Token saved in {path}.")
    return OK


# submit, estimate ----------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    spec_path, text = read_spec(args.spec)
    spec_name = spec_path.name
    refs = local_refs(text, spec_name, spec_path.parent)
    check_exist(refs, spec_name)
    with connect(args) as client:
        files = upload_files(refs)
        try:
            total = sum(size_of(f) for _, _, f in files)
            with ui.progress_bar(total, f"uploading {len(files)} file(s)", enabled=not args.json and bool(files)) as bar:
                parts = [(field, (name, ui.ProgressReader(f, bar), "application/octet-stream")) for field, name, f in files]
                job = client.post("/api/jobs/", data={"spec": text, "spec_name": spec_name}, files=parts or None)
        finally:
            for _, _, f in files:
                f.close()
        return submitted(client, job, args)


def submitted(client: Client, job: dict[str, Any], args: argparse.Namespace) -> int:
    """Report a new job; follow it with --follow."""
    if args.json:
        sys.stdout.write(json.dumps(job, default=str) + "\n")
        sys.stdout.flush()
    else:
        print(f"Submitted job {job['id']} ({job.get('name', '')}): {job.get('state', '')}")
        if job.get("url"):
            print(job["url"])
    if not getattr(args, "follow", False):
        return OK
    return follow(client, job["id"], args.json)


def follow(client: Client, job_id: str, as_json: bool, after: int = 0) -> int:
    state = Follower(client, job_id, Printer(as_json=as_json), after=after).run()
    if as_json:
        sys.stdout.write(json.dumps({"id": job_id, "state": state, "done": True}) + "\n")
    else:
        say(f"Job {short(job_id)} {state}.")
    return OK if state == "succeeded" else JOB_FAILED


def cmd_estimate(args: argparse.Namespace) -> int:
    spec_path, text = read_spec(args.spec)
    with connect(args) as client:
        estimate = client.post("/api/estimate/", data={"spec": text, "spec_name": spec_path.name})
    if args.json:
        ui.print_json(estimate)
        return OK
    if isinstance(estimate, dict):
        ui.print_fields(
            [(k.replace("_", " "), when(v) if k.endswith(("_start", "_finish", "_at")) else v) for k, v in estimate.items()],
            title=f"Estimate for {spec_path.name}",
        )
    else:
        print(estimate)
    return OK


# status, logs, cancel --------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    with connect(args) as client:
        if args.job:
            job = client.job(client.resolve_job(args.job))
            if args.json:
                ui.print_json(job)
            else:
                show_job(job)
            return OK
        jobs = client.pages("/api/jobs/", limit=args.limit)
    if args.json:
        ui.print_json(jobs)
        return OK
    if not jobs:
        print("No jobs yet.")
        return OK
    ui.print_table(
        ["id", "name", "state", "gpus", "cost", "created"],
        [(short(j.get("id")), j.get("name"), j.get("state"), j.get("gpus"), cost(j), when(j.get("created_at"))) for j in jobs],
    )
    return OK


def cost(job: dict[str, Any]) -> str:
    return f"{job.get('cost', '')} {job.get('currency', '')}".strip()


def show_job(job: dict[str, Any]) -> None:
    fields = [
        ("id", job.get("id")),
        ("name", job.get("name")),
        ("kind", job.get("kind")),
        ("recipe", job.get("recipe")),
        ("state", job.get("state")),
        ("reason", job.get("reason")),
        ("waiting for", job.get("wait_reason") if job.get("state") == "queued" else None),
        ("gpus", f"{job.get('gpus')} {job.get('gpu_type') or ''}".strip()),
        ("mode", job.get("mode")),
        ("span hours", job.get("span_hours")),
        ("cost", cost(job)),
        ("created", when(job.get("created_at"))),
        ("predicted start", when(job.get("predicted_start"))),
        ("predicted finish", when(job.get("predicted_finish"))),
        ("finished", when(job.get("finished_at"))),
        ("exit code", job.get("exit_code")),
        ("train data", job.get("train_dataset")),
        ("heldout data", job.get("heldout_dataset")),
        ("parent", job.get("parent")),
        ("restarts", job.get("restarts") or None),
        ("preemptions", job.get("preemptions") or None),
        ("url", job.get("url")),
    ]
    ui.print_fields(fields)


def cmd_logs(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job_id = client.resolve_job(args.job)
        if args.follow:
            return follow(client, job_id, args.json)
        _, _state = print_logs(client, job_id, Printer(as_json=args.json))
    return OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job_id = client.resolve_job(args.job)
        job = client.post(f"/api/jobs/{job_id}/cancel/")
    if args.json:
        ui.print_json(job)
    else:
        print(f"Cancelling job {job_id} ({job.get('name', '')}).")
    return OK


# retrain -------------------------------------------------------------------------------------


def cmd_retrain(args: argparse.Namespace) -> int:
    overrides = {key: getattr(args, key) for key in RETRAIN_OPTIONS if getattr(args, key) is not None}
    if args.preemptible is not None:
        overrides["preemptible"] = args.preemptible
    if args.args is not None:
        overrides["args"] = args.args
    if args.input:
        overrides["inputs"] = {name: str(ref) for name, ref in assignments(args.input, "--input").items()}
    hyperparameters, config = assignments(args.hp, "--hp"), assignments(args.set, "--set")
    paths = [Path(p) for p in args.add_data or []]
    for path in paths:
        if not path.exists():
            raise CliError(f"{path} does not exist.", USAGE)
    with connect(args) as client:
        job_id = client.resolve_job(args.job)
        if hyperparameters or config:  # changes to the job's own: what is not named stays
            current = client.get(f"/api/jobs/{job_id}/")
            if hyperparameters:
                overrides["hyperparameters"] = {**(current.get("hyperparameters") or {}), **hyperparameters}
            if config:
                overrides["config"] = {k: v for k, v in {**(current.get("config") or {}), **config}.items() if k != "mode"}
        files = [(name, open(p, "rb")) for path in paths for name, p in files_of(path)]  # noqa: SIM115 - closed in the finally below
        try:
            total = sum(size_of(f) for _, f in files)
            with ui.progress_bar(total, f"uploading {len(files)} file(s)", enabled=not args.json and bool(files)) as bar:
                parts = [("data", (name, ui.ProgressReader(f, bar), "application/octet-stream")) for name, f in files]
                job = client.post(f"/api/jobs/{job_id}/retrain/", data={"spec": json.dumps(overrides)}, files=parts or None)
        finally:
            for _, f in files:
                f.close()
        return submitted(client, job, args)


# download ------------------------------------------------------------------------------------


def safe_target(folder: Path, name: str) -> Path:
    """Where an artifact named `name` goes under folder; refuses names that would escape it."""
    if not name or "\\" in name or "\x00" in name:
        raise CliError(f"Refusing the file name {name!r} from the server.", SERVER)
    pure = PurePosixPath(name)
    if pure.is_absolute() or any(part in ("..", "") for part in pure.parts) or ":" in pure.parts[0]:
        raise CliError(f"Refusing the file name {name!r} from the server: it would be written outside {folder}.", SERVER)
    target = (folder / Path(*pure.parts)).resolve()
    if not target.is_relative_to(folder.resolve()):
        raise CliError(f"Refusing the file name {name!r} from the server: it would be written outside {folder}.", SERVER)
    return target


def fetch(client: Client, path: str, target: Path, bar: ui.ProgressBar, sha256: str | None = None) -> None:
    """Stream path into target (through a .part file); check the SHA-256 if given."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.part")
    digest = hashlib.sha256()
    try:
        with client.http.stream("GET", path) as response:
            if not response.is_success:
                response.read()
                from e31.cli.client import check

                check(response)
            with open(part, "wb") as out:
                for block in response.iter_bytes(1024 * 1024):
                    out.write(block)
                    digest.update(block)
                    bar.advance(len(block))
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if sha256 and digest.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise CliError(f"{target.name}: the download's SHA-256 is {digest.hexdigest()}, not {sha256} as the server says; try again.", SERVER)
    os.replace(part, target)


def cmd_download(args: argparse.Namespace) -> int:
    import httpx

    with connect(args) as client:
        job_id = client.resolve_job(args.job)
        job = client.job(job_id)
        artifacts = client.get(f"/api/jobs/{job_id}/artifacts/")
        if isinstance(artifacts, dict):
            artifacts = artifacts.get("results") or artifacts.get("artifacts") or []
        folder = Path(args.to) if args.to else Path(f"{safe_name(job.get('name') or 'job')}-{short(job_id)}")
        folder.mkdir(parents=True, exist_ok=True)
        plan = [(a, safe_target(folder, a["name"])) for a in artifacts]  # refuse bad names before writing any
        done = []
        with ui.progress_bar(sum(a.get("size") or 0 for a in artifacts), "downloading", enabled=not args.json) as bar:
            for artifact, target in plan:
                entry = {"name": artifact["name"], "path": str(target), "size": artifact.get("size"), "sha256": artifact.get("sha256")}
                if target.is_file() and artifact.get("sha256") and sha256_of(target) == artifact["sha256"]:
                    bar.advance(artifact.get("size") or 0)
                    done.append({**entry, "skipped": True})
                    continue
                try:
                    fetch(client, f"/api/jobs/{job_id}/artifacts/{quote(artifact['name'], safe='/')}", target, bar, artifact.get("sha256"))
                except httpx.HTTPError as error:
                    raise CliError(f"Downloading {artifact['name']} failed: {error}", SERVER) from None
                done.append({**entry, "skipped": False})
    if args.json:
        ui.print_json({"job": job_id, "folder": str(folder), "files": done})
    else:
        fetched = sum(1 for d in done if not d["skipped"])
        print(f"{len(done)} file(s) in {folder}/ ({fetched} downloaded, {len(done) - fetched} already there).")
    return OK


def safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip(".-") or "job"


# datasets ------------------------------------------------------------------------------------


def cmd_datasets_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        found = client.pages("/api/datasets/")
    if args.json:
        ui.print_json(found)
        return OK
    if not found:
        print("No datasets yet.")
        return OK
    ui.print_table(
        ["name", "state", "latest", "open", "files", "bytes", "source"],
        [
            (d.get("name"), d.get("state"), d.get("latest_version"), d.get("open_version"), d.get("files"), f"{d.get('bytes') or 0:,}", d.get("source"))
            for d in found
        ],
    )
    return OK


def cmd_datasets_upload(args: argparse.Namespace) -> int:
    from e31.cli.datasets import Uploader

    folder = Path(args.dir)
    name = args.name or folder.resolve().name
    with connect(args) as client:
        uploader = Uploader(client, say=say if not args.json else (lambda text: None))
        try:
            with ui.progress_bar(0, f"uploading to {name}", enabled=not args.json) as bar:
                result = uploader.upload(folder, name, bar)
        except KeyboardInterrupt:
            say(f"Interrupted after sending {uploader.sent_bytes:,} bytes; run the same command again to continue.")
            if args.json:
                ui.print_json({"dataset": name, "interrupted": True, "sent_bytes": uploader.sent_bytes, "resumed_bytes": uploader.resumed_bytes})
            return INTERRUPTED
    if args.json:
        ui.print_json(result)
    elif result["up_to_date"]:
        print(f"{result['ref']} already holds these {result['files']} file(s): nothing to upload.")
    else:
        resumed = f", {result['resumed_bytes']:,} resumed" if result["resumed_bytes"] else ""
        print(
            f"Sealed {result['ref']}: {result['files']} file(s), {result['bytes']:,} bytes ({result['sent_bytes']:,} sent{resumed}, "
            f"{len(result['skipped_files'])} file(s) already there)."
        )
    return OK


# invoices ------------------------------------------------------------------------------------


def cmd_invoices(args: argparse.Namespace) -> int:
    with connect(args) as client:
        invoices = client.pages("/api/invoices/")
        saved = []
        if args.pdf:
            folder = Path(args.to or ".")
            folder.mkdir(parents=True, exist_ok=True)
            with ui.progress_bar(None, "downloading invoices", enabled=not args.json) as bar:
                for invoice in invoices:
                    target = safe_target(folder, f"{safe_name(str(invoice.get('number') or invoice['id']))}.pdf")
                    fetch(client, f"/api/invoices/{invoice['id']}.pdf", target, bar)
                    saved.append(str(target))
    if args.json:
        ui.print_json({"invoices": invoices, "pdfs": saved} if args.pdf else invoices)
        return OK
    if not invoices:
        print("No invoices yet.")
    else:
        ui.print_table(
            ["number", "period", "kind", "state", "total", "issued"],
            [
                (
                    i.get("number"),
                    i.get("period"),
                    i.get("kind"),
                    i.get("state"),
                    f"{i.get('total', '')} {i.get('currency', '')}".strip(),
                    when(i.get("issued_at")),
                )
                for i in invoices
            ],
        )
    for path in saved:
        print(f"saved {path}")
    return OK


# The command line ----------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> Parser:
    common = Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON on stdout instead of tables")
    common.add_argument("--server", help="the server's URL (default: E31_SERVER, else the one from `e31 login`)")

    parser = Parser(prog="e31", description="Submit and follow training jobs on E31 Network.", parents=[])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    p = commands.add_parser("login", parents=[common], help="log in and keep a token")
    p.add_argument("--username")
    p.add_argument("--token", help="an API token to use instead of a password")
    p.add_argument("--password-stdin", action="store_true", help="read the password from standard input (scripts)")
    p.set_defaults(func=cmd_login)

    p = commands.add_parser("submit", parents=[common], help="submit a job spec (YAML or JSON), uploading its local files")
    p.add_argument("spec")
    p.add_argument("-f", "--follow", action="store_true", help="print the job's log until it ends; exit 1 unless it succeeds")
    p.set_defaults(func=cmd_submit)

    p = commands.add_parser("estimate", parents=[common], help="what a spec would cost, and when it would run")
    p.add_argument("spec")
    p.set_defaults(func=cmd_estimate)

    p = commands.add_parser("status", parents=[common], help="your team's jobs, or one job")
    p.add_argument("job", nargs="?", help="a job id or the start of one")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=cmd_status)

    p = commands.add_parser("logs", parents=[common], help="a job's log")
    p.add_argument("job")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=cmd_logs)

    p = commands.add_parser("cancel", parents=[common], help="cancel a job")
    p.add_argument("job")
    p.set_defaults(func=cmd_cancel)

    p = commands.add_parser("retrain", parents=[common], help="train a finished job again on more data")
    p.add_argument("job")
    p.add_argument("--add-data", action="append", metavar="PATH", help="a file or folder of new training data (repeatable)")
    p.add_argument("--name")
    p.add_argument("--gpus", type=int)
    p.add_argument("--gpu-type", dest="gpu_type")
    p.add_argument("--mode", choices=["span", "until_done"])
    p.add_argument("--span-hours", dest="span_hours")
    p.add_argument("--ceiling-kind", dest="ceiling_kind")
    p.add_argument("--ceiling")
    p.add_argument("--not-before", dest="not_before")
    p.add_argument("--by", help="e.g. morning")
    p.add_argument("--deadline")
    p.add_argument("--preemptible", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--args", help="the script's arguments instead of the job's, as on a command line")
    p.add_argument("--hp", action="append", metavar="NAME=VALUE", help="change a hyperparameter (repeatable); the others stay")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="change a key of the config (repeatable); the others stay")
    p.add_argument("--input", action="append", metavar="NAME=DATASET[@N]", help="read another dataset version as this named input (repeatable)")
    p.add_argument("-f", "--follow", action="store_true")
    p.set_defaults(func=cmd_retrain)

    p = commands.add_parser("download", parents=[common], help="download a job's output files")
    p.add_argument("job")
    p.add_argument("--to", help="the folder (default ./<job name>-<short id>/)")
    p.set_defaults(func=cmd_download)

    datasets = commands.add_parser("datasets", help="upload and list datasets")
    sub = datasets.add_subparsers(dest="datasets_command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    p = sub.add_parser("upload", parents=[common], help="upload a folder as a dataset's new version (resumable)")
    p.add_argument("dir")
    p.add_argument("--name", help="the dataset's name (default: the folder's name)")
    p.set_defaults(func=cmd_datasets_upload)
    p = sub.add_parser("list", parents=[common], help="your team's datasets")
    p.set_defaults(func=cmd_datasets_list)

    sweeps.add_commands(commands, common, Parser, with_client)

    p = commands.add_parser("invoices", parents=[common], help="your team's invoices")
    p.add_argument("--pdf", action="store_true", help="download each invoice's PDF")
    p.add_argument("--to", help="the folder for the PDFs (default: here)")
    p.set_defaults(func=cmd_invoices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error (2)
        return done.code if isinstance(done.code, int) else USAGE
    try:
        return args.func(args)
    except CliError as error:
        message = error.message
        if error.code == AUTH and error.status in (401, 403) and args.command != "login":
            message += "\n(Log in again with `e31 login`, or check E31_TOKEN.)"
        sys.stderr.write("\n".join(f"e31: {line}" if i == 0 else line for i, line in enumerate(message.splitlines())) + "\n")
        return error.code
    except KeyboardInterrupt:
        say("e31: interrupted")
        return INTERRUPTED
    except BrokenPipeError:
        return OK
