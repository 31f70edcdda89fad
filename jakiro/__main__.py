"""``python -m jakiro`` = the ``jakiro`` command."""

import sys

from .cli import main

sys.exit(main())
