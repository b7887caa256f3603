"""``python -m atomicstore``: the same as the ``atomicstore`` command."""

import sys

from .cli import main

sys.exit(main())
