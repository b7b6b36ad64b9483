"""e31: the E31 Network command-line client. Needs neither Django nor torch."""

import sys


def main(argv=None):
    from e31.cli.commands import main as run

    return run(sys.argv[1:] if argv is None else argv)
