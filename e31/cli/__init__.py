"""e31: the E31 Network command-line client. Needs neither Django nor torch."""

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from e31.cli.commands import main as run

    return run(sys.argv[1:] if argv is None else argv)
