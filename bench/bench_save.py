"""The benchmark suite; the same as ``parallel-dcp bench`` (see parallel_dcp/benchmark/__init__.py).

python bench/bench_save.py --gib 2 --targets shm --sync on --json bench.json --plot bench.png
python bench/bench_save.py --suite small --small 50000 --targets shm
python bench/bench_save.py --suite convert --gib 2 --targets shm disk
python bench/bench_save.py --help
"""

import sys

from parallel_dcp.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
