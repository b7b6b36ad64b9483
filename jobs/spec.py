"""Parsing the free-text parts of a job description: pure functions, no database."""

import re
import shlex

from jobs import specfile
from scheduler.launch import RESERVED_ENV

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SpecError(ValueError):
    pass


def parse_config(text):
    """A config given as JSON or YAML text; must be a mapping. Empty text is an empty config."""
    if not text or not text.strip():
        return {}
    try:
        value = specfile.parse(text.strip())
    except specfile.ParseError as error:
        where = f" (line {error.line}, column {error.column})" if error.column else f" (line {error.line})" if error.line else ""
        raise SpecError(f"the config is {error}{where}") from None
    if not isinstance(value, dict):
        raise SpecError("the config must be a mapping of names to values (a JSON object or YAML mapping)")
    if _has_nul(value):
        raise SpecError("the config contains a NUL character")
    return value


def _has_nul(value):
    """True if any string in the parsed config holds a NUL (the database cannot store it)."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def parse_args(text):
    """Arguments as a shell would split them."""
    try:
        return shlex.split(text or "")
    except ValueError as error:
        raise SpecError(f"the arguments cannot be split: {error}") from None


def parse_env(text):
    """KEY=VALUE lines (blank lines and # comments ignored)."""
    env = {}
    for number, line in enumerate((text or "").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep:
            raise SpecError(f"line {number}: expected NAME=value")
        if not ENV_NAME.match(name):
            raise SpecError(f"line {number}: {name!r} is not a valid variable name")
        if name.startswith(RESERVED_ENV):
            raise SpecError(f"line {number}: {name} is set by the network and cannot be overridden")
        env[name] = value
    return env


def format_env(env):
    return "\n".join(f"{name}={value}" for name, value in env.items())
