"""``python -m parallel_dcp.cli``, as ``python -m parallel_dcp``."""

import sys

from parallel_dcp.cli import main

sys.exit(main())
