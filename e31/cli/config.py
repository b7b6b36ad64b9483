"""Where the client keeps the server's address and the token: a JSON file only its owner can
read, in the user's config folder (E31_CONFIG_DIR overrides the folder; E31_SERVER and
E31_TOKEN override what the file says)."""

import json
import os
from pathlib import Path
from typing import Any

from e31.cli.errors import AUTH, CliError

DEFAULT_SERVER = "http://127.0.0.1:8000"


def config_dir() -> Path:
    if os.environ.get("E31_CONFIG_DIR"):
        return Path(os.environ["E31_CONFIG_DIR"])
    import platformdirs

    return Path(platformdirs.user_config_dir("e31"))


def config_path() -> Path:
    return config_dir() / "config.json"


def read_file() -> dict[str, Any]:
    try:
        value = json.loads(config_path().read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load() -> dict[str, str | None]:
    """{"server", "token"}: the environment's, else the file's; either may be None."""
    stored = read_file()
    server = os.environ.get("E31_SERVER") or stored.get("server") or None
    token = os.environ.get("E31_TOKEN") or stored.get("token") or None
    return {"server": server.rstrip("/") if server else None, "token": token}


def require(server_override: str | None = None) -> dict[str, str]:
    settings = load()
    if server_override:
        settings["server"] = server_override.rstrip("/")
    server, token = settings["server"], settings["token"]
    if not server or not token:
        raise CliError("Not logged in: run `e31 login` (or set E31_SERVER and E31_TOKEN).", AUTH)
    return {"server": server, "token": token}


def save(server: str, token: str) -> Path:
    """Write the config with 0600 permissions (the folder 0700); returns the file's path."""
    folder = config_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = config_path()
    tmp = path.with_name(f".config.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # even if an old temporary file had looser permissions
        with os.fdopen(fd, "w") as f:
            json.dump({"server": server.rstrip("/"), "token": token}, f, indent=2)
            f.write("\n")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def state_path(name: str) -> Path:
    """A small file of the client's own state (resumable uploads) next to the config."""
    return config_dir() / name
