"""``python -m bench``: run W1, W2, W3 and W4, write bench/results/latest.json and
docs/performance.md (see ``python -m bench --help``)."""

import sys

from .runner import main

sys.exit(main())
