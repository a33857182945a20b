"""``python -m lik.bench``: the same as ``lik bench``."""

import sys

from . import main

sys.exit(main())
