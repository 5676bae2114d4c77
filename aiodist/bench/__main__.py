"""``python -m aiodist.bench``: the same as the ``aiodist-bench`` command."""

import sys

from aiodist.bench.cli import main

sys.exit(main())
