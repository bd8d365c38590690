"""``python -m bench``: run W1, W2 and W3, write bench/results/latest.json and
docs/performance.md (see ``python -m bench --help``)."""

import sys

from .runner import main

sys.exit(main())
