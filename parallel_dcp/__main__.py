import sys

from parallel_dcp.cli import main

sys.exit(main())
