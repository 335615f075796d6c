"""A Saver's layout check, chunk by chunk (main) against one chunk (the passes as they ran before), in one process.

Usage: flock LOCK python bench/bench_layout_check_chunks.py [ROUNDS]   (default 9)

Two `Saver(workers=1)` hold `synthetic.many_small(50000)`: one made its layout guard with `_compat.GUARD_CHUNK`
at 512 (the type, `data_ptr` and guard passes run 512 tensors at a time), the other with one chunk of all 50,000
(each pass over every tensor in turn, as before 2026-12-06). They take turns, one later save a round; per save,
the CPU seconds of the layout check (`Speculation.confirm`). Prints the medians and every round's figure.
"""

import functools
import gc
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import parallel_dcp
from parallel_dcp import _compat
from parallel_dcp.jobs import speculation
from parallel_dcp.synthetic import many_small

warnings.filterwarnings("ignore")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    took: list[float] = []
    confirm = speculation.Speculation.confirm

    @functools.wraps(confirm)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return confirm(*args, **kwargs)
        finally:
            took.append(time.thread_time() - began)

    speculation.Speculation.confirm = timed  # type: ignore[method-assign]
    sd = many_small(50000)
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="chunks-")
    out = f"{root}/ck"
    savers = {}
    try:
        for chunk in (512, 10**9):
            _compat.GUARD_CHUNK = chunk  # the guard is made (with its chunk) at the second save
            savers[chunk] = parallel_dcp.Saver(workers=1)
            for _ in range(3):
                savers[chunk].save(sd, out)
                shutil.rmtree(out)
        found: dict[int, list[float]] = {chunk: [] for chunk in savers}
        for rnd in range(rounds):
            for chunk in savers if rnd % 2 else list(savers)[::-1]:
                took.clear()
                gc.collect()
                savers[chunk].save(sd, out)
                shutil.rmtree(out)
                found[chunk].append(sum(took))
    finally:
        for saver in savers.values():
            saver.close()
        shutil.rmtree(root, ignore_errors=True)
    for chunk, seconds in found.items():
        label = "chunks of 512" if chunk == 512 else "one chunk (before)"
        print(
            f"{label}: layout check median {statistics.median(seconds) * 1e3:.1f} ms",
            [round(s * 1e3, 1) for s in seconds],
        )


if __name__ == "__main__":
    main()
