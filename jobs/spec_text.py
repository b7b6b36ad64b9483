"""Parsing the free-text parts of a job description (arguments, environment, config, variables in them): pure functions, no database."""

import re
import shlex

from jobs import launch, specfile

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


def parse_env(text, hyperparameters=()):
    """KEY=VALUE lines (blank lines and # comments ignored). A name the network sets (for a job
    with these hyperparameters) is refused, saying what the network sets it to."""
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
        if reason := launch.refused_env_name(name, hyperparameters):
            raise SpecError(f"line {number}: {reason}")
        env[name] = value
    return env


HYPERPARAMETER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def parse_hyperparameters(text):
    """A flat mapping of names to text, numbers or booleans, given as JSON or YAML text (each
    is passed to the script as --name value)."""
    if isinstance(text, dict):
        value = text
    else:
        try:
            value = parse_config(text)
        except SpecError as error:
            raise SpecError(str(error).replace("the config", "the hyperparameters", 1)) from None
    for name, item in value.items():
        if not HYPERPARAMETER_NAME.match(str(name)):
            raise SpecError(f"hyperparameter {name!r}: a name is letters, digits and _ . - (it becomes --{name})")
        if item is None or isinstance(item, (dict, list)):
            raise SpecError(f"hyperparameter {name}: a value is text, a number or true/false (each is passed as --{name} value)")
    return value


def check_variables(texts, known):
    """Each $NAME the texts use is one of known (the job's environment); SpecError otherwise."""
    for text in texts:
        for name in launch.variables_in(str(text)):
            if name not in known:
                raise SpecError(
                    f"${name} is not a variable of the job's environment: use $E31_DATA_DIR, $E31_OUTPUT_DIR, "
                    "$E31_CHECKPOINT_DIR, $E31_MODEL_DIR, $SM_CHANNEL_TRAIN, ... or one the job sets ($$ is a plain $)"
                )


def format_env(env):
    return "\n".join(f"{name}={value}" for name, value in env.items())


def parse_inputs(text):
    """Named inputs (SageMaker's channels), given as a mapping (JSON or YAML text, or a dict) of
    name to the dataset that fills it: "digits", "digits@2", or {dataset: "digits@2"}; or
    {files: [...]}, files sent with the job. Returns {name: dataset reference, or None for
    files}; SpecError for a bad name or value."""
    if isinstance(text, dict):
        value = text
    else:
        try:
            value = parse_config(text)
        except SpecError as error:
            raise SpecError(str(error).replace("the config", "the inputs", 1)) from None
    found = {}
    for name, ref in value.items():
        if problem := launch.input_name_problem(name, value):
            raise SpecError(f"input {problem}")
        if isinstance(ref, dict) and set(ref) == {"dataset"}:
            ref = ref["dataset"]
        elif isinstance(ref, dict) and set(ref) == {"files"}:
            found[name] = None  # files sent with the job, in the field input:<name>
            continue
        if not isinstance(ref, str) or not ref.strip():
            raise SpecError(f"input {name}: name the dataset that fills it (digits, or digits@2 for its version 2), or its files ({{files: [a.csv]}})")
        found[name] = ref.strip()
    return found
