"""``python -m onceonly.demo`` runs the demo (as ``onceonly demo`` with its defaults)."""

import sys

from . import main

sys.exit(main())
