"""``python -m bench run [--quick] [NAME ...]`` and ``python -m bench list``: see bench.runner."""

import sys

from bench.runner import main

sys.exit(main())
