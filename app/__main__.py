"""``python -m feedline``: the same command line as the ``feedline`` command."""

import sys

from .appliance.cli import main

sys.exit(main())
