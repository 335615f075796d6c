"""The save benchmark; the same as ``parallel-dcp bench`` (see parallel_dcp/benchmark.py).

python bench/bench_save.py --gib 2 --reps 5 --dir /dev/shm
python bench/bench_save.py --small 50000 --reps 5
"""

import sys

from parallel_dcp.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
