"""Save throughput to S3-compatible object storage: parallel_dcp against stock DCP's FsspecWriter.

python bench/bench_s3.py --moto --gib 0.5 --repeat 3               # a local moto server (tests' helper)
python bench/bench_s3.py --url s3://bucket/bench --endpoint http://minio:9000 --gib 4

Runs are interleaved (each round runs every writer once, into a fresh prefix that is deleted
afterwards); the table shows medians and the ratio to stock ``dcp.save`` with defaults. A local
moto server is a Python process on the same cores: its figures show the client side's overhead,
not what a real object store sustains.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

import parallel_dcp
from parallel_dcp.synthetic import llm_like


@contextlib.contextmanager
def _moto() -> Iterator[str]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.s3_server import CREDENTIALS, moto_server

    os.environ.update(CREDENTIALS)
    with moto_server() as endpoint:
        yield endpoint


def _writers(workers: int, options: dict[str, Any]) -> dict[str, Callable[[Any, str], None]]:
    def ours(executor: str) -> Callable[[Any, str], None]:
        return lambda sd, url: (
            parallel_dcp.save(sd, url, workers=workers, executor=executor, storage_options=options) and None
        )

    def stock(threads: int) -> Callable[[Any, str], None]:
        return lambda sd, url: dcp.save(sd, storage_writer=FsspecWriter(url, thread_count=threads, **options)) and None

    return {
        f"parallel_dcp w={workers} (processes)": ours("processes"),
        f"parallel_dcp w={workers} (auto)": ours("auto"),
        "stock dcp.save FsspecWriter (defaults)": stock(1),
        f"stock dcp.save FsspecWriter thread_count={workers}": stock(workers),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="s3://bucket/prefix to write under (default with --moto: a new bucket)")
    parser.add_argument("--endpoint", help="endpoint_url for an S3-compatible server")
    parser.add_argument("--moto", action="store_true", help="start a local moto server and write there")
    parser.add_argument("--gib", type=float, default=0.5, help="size of the LLM-like state dict")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not args.moto and not args.url:
        parser.error("give --url (and --endpoint), or --moto")
    import s3fs

    with _moto() if args.moto else contextlib.nullcontext(args.endpoint) as endpoint:
        options = {"endpoint_url": endpoint} if endpoint else {}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        root = args.url
        if root is None:
            root = f"s3://bench-{uuid.uuid4().hex[:8]}"
            fs.mkdir(root.removeprefix("s3://"))
        state = llm_like(args.gib)
        nbytes = sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
        writers = _writers(args.workers, options)
        seconds: dict[str, list[float]] = {name: [] for name in writers}
        for _ in range(args.repeat):
            for name, write in writers.items():
                url = f"{root.rstrip('/')}/{uuid.uuid4().hex[:8]}"
                start = time.perf_counter()
                write(state, url)
                seconds[name].append(time.perf_counter() - start)
                fs.rm(url.removeprefix("s3://"), recursive=True)
        base = statistics.median(seconds["stock dcp.save FsspecWriter (defaults)"])
        print(
            f"{nbytes / 2**30:.2f} GiB to {root} ({'moto' if args.moto else endpoint or 'AWS'}), "
            f"medians of {args.repeat}"
        )
        for name, runs in seconds.items():
            median = statistics.median(runs)
            print(f"  {name:48s} {nbytes / 2**30 / median:6.3f} GiB/s  {base / median:5.2f}x stock")
    return 0


if __name__ == "__main__":
    sys.exit(main())
