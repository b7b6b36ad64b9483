"""Parsing the free-text parts of a job description: pure functions, no database."""

import json
import re
import shlex

import yaml

from scheduler.launch import RESERVED_ENV

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SpecError(ValueError):
    pass


def parse_config(text):
    """A config given as JSON or YAML text; must be a mapping. Empty text is an empty config."""
    if not text or not text.strip():
        return {}
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as error:
            raise SpecError(f"the config is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})") from None
    else:
        try:
            value = yaml.safe_load(stripped)
        except yaml.YAMLError as error:
            where = ""
            mark = getattr(error, "problem_mark", None)
            if mark is not None:
                where = f" (line {mark.line + 1}, column {mark.column + 1})"
            problem = getattr(error, "problem", None) or str(error)
            raise SpecError(f"the config is not valid YAML: {problem}{where}") from None
    if not isinstance(value, dict):
        raise SpecError("the config must be a mapping of names to values (a JSON object or YAML mapping)")
    return value


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
