"""The Python packages a job brings: requirements.txt lines, checked before the job is queued.

The node builds the job's environment with uv from the package index while the job waits, so
only plain PEP 508 requirements (a name, extras, versions, markers) are taken. Options (-e, -r,
--index-url), URLs and local paths would make the build reach places the network does not
choose or read files the job cannot send, so they are refused here, naming the line, rather than
failing on the node after the job waited. torch is taken as given: the builder checks it against
the node's own torch. Pure functions, no database.
"""

import hashlib
import re

# packaging (15 ms) is imported where a requirement is parsed: the node agent, whose start inside
# a Slurm job is on the meter, imports this module for packages_digest and parses none.

MAX_REQUIREMENTS = 200
MAX_LINE = 200
# pip's rule: a # at the start of a line, or after whitespace, starts a comment.
COMMENT = re.compile(r"(^|\s)#.*$")
URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:(//|/)|^(git|hg|svn|bzr)\+")
PATH_START = (".", "/", "\\", "~")
FILE_SUFFIXES = (".whl", ".tar.gz", ".tgz", ".tar.bz2", ".zip")
BY_NAME = "packages come from the package index, by name (numpy>=1.26)"


class PackagesError(ValueError):
    """A requirement that cannot be taken; `line` is its number (None for the whole text)."""

    def __init__(self, message, line=None):
        self.line = line
        super().__init__(message)


def parse(text):
    """The requirements in `text`, one a line, stripped, comments and blank lines left out;
    raises PackagesError naming the first line that is not a plain requirement."""
    found = []
    for number, raw in enumerate((text or "").splitlines(), start=1):
        line = COMMENT.sub("", raw).strip()
        if not line:
            continue
        _check(number, line)
        found.append(line)
        if len(found) > MAX_REQUIREMENTS:
            raise PackagesError(f"more than {MAX_REQUIREMENTS} requirements: a job may name at most {MAX_REQUIREMENTS}")
    return found


def merge(*texts):
    """The requirements of every text as one text, one a line, in order; a requirement named
    again (even spelt otherwise: numpy >= 1.26, numpy>=1.26) is kept once, as first given."""
    from packaging.requirements import Requirement

    kept = {}
    for text in texts:
        for line in parse(text):
            kept.setdefault(str(Requirement(line)), line)
    if len(kept) > MAX_REQUIREMENTS:
        raise PackagesError(f"{len(kept)} requirements in all: a job may name at most {MAX_REQUIREMENTS}")
    return "\n".join(kept.values())


def _check(number, line):
    if len(line) > MAX_LINE:
        raise PackagesError(f"line {number} ({line[:40]}...) is longer than {MAX_LINE} characters", number)
    reason = _refusal(line)
    if reason:
        raise PackagesError(f"line {number} ({line}): {reason}", number)


def _refusal(line):
    """Why a (stripped, comment-free) line is not taken, or None for a plain requirement."""
    if line.startswith("-"):
        return f"options such as -e, -r and --index-url are not taken; {BY_NAME}"
    if line.endswith("\\"):
        return "a line continuation (\\) is not taken: one requirement a line"
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(line)
    except InvalidRequirement as error:
        if URL.search(line):
            return f"a URL is not taken; {BY_NAME}"
        if line.startswith(PATH_START) or "/" in line or "\\" in line:
            return f"a local path is not taken; {BY_NAME}"
        return f"not a requirement: {str(error).splitlines()[0]}"
    if requirement.url:
        return f"a direct reference (name @ URL) is not taken; {BY_NAME}"
    if requirement.name.lower().endswith(FILE_SUFFIXES):
        return f"a package file is not taken; {BY_NAME}"
    return None


def packages_digest(requirements):
    """What the scheduler knows an environment by, the same on every node (a node's own key also
    holds its runtime and index): the sha256 of the requirements, sorted."""
    return hashlib.sha256(("packages\n" + "\n".join(sorted(requirements))).encode()).hexdigest()


def requirements_of(job):
    """The job's requirements, one a line (jobs.packages has checked them at submission)."""
    return [line.strip() for line in (getattr(job, "packages", "") or "").splitlines() if line.strip()]
