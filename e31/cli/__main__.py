import sys

from e31.cli import main

sys.exit(main())
