"""``python -m kvtiers.commands``: the ``kvtiers`` command."""

import sys

from .cli import main

sys.exit(main())
