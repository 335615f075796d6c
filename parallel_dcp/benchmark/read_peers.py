"""The readers ``bench --suite read`` holds parallel_dcp to, beside stock: fastsafetensors and the
Run:ai model streamer (each when installed: the ``.[bench]`` extra; else a row saying why), and the
device's limit: fio reading the same files with O_DIRECT (when on PATH) and the plain reads."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from parallel_dcp.benchmark.device import plain_read, queued_read
from parallel_dcp.benchmark.measure import Case
from parallel_dcp.formats.span_read import REQUEST_BYTES
from parallel_dcp.jobs.load_files import SPAN_REQUESTS_PER_THREAD

__all__ = ["PEER_THREADS", "fio_read", "fresh_row", "limit_rows", "peer_rows", "plain_rows", "version"]

PEER_THREADS = 16
_FIO_BLOCK = 8 << 20
_FST_ODIRECT = "FASTSAFETENSORS_ODIRECT"


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def fio_read(files: list[str], jobs: int) -> Callable[[str], dict[str, Any]]:
    """fio reading ``files`` whole with O_DIRECT (libaio, iodepth 8, 8 MiB blocks, 1 MiB where a
    file is smaller), the files dealt to ``jobs`` jobs read at once; fio refuses a file smaller
    than its block, so such files (a DCP checkpoint's tiny shards) are left out and counted.
    Details: ``fio_seconds``, fio's own runtime of every run (its start-up, about half a second on
    a busy VM, is in the wall time but is no part of the device's limit)."""
    runtimes: list[float] = []

    def run(out: str) -> dict[str, Any]:
        block = _FIO_BLOCK if all(os.path.getsize(f) >= _FIO_BLOCK for f in files) else 1 << 20
        used = [f for f in files if os.path.getsize(f) >= block]
        if not used:
            raise RuntimeError(f"every file is smaller than fio's {block >> 20} MiB block")
        args = ["fio", "--rw=read", f"--bs={block >> 20}m", "--direct=1", "--ioengine=libaio", "--iodepth=8"]
        args += ["--file_service_type=sequential", "--group_reporting", "--output-format=json"]
        for job in range(jobs):
            mine = used[job::jobs]
            if mine:
                args += [f"--name=read{job}", "--filename=" + ":".join(f.replace(":", "\\:") for f in mine)]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        read = json.loads(done.stdout)["jobs"][0]["read"]
        left = sum(os.path.getsize(f) for f in files if f not in used)
        runtimes.append(int(read["runtime"]) / 1000)
        return {"tool": "fio", "fio_bytes": int(read["io_bytes"]), "bytes_left_out": left, "fio_seconds": runtimes}

    return run


def peer_rows(files: list[str], baseline: str, limit: str, prepare: Callable[[], bool]) -> list[Case]:
    """The peers' rows over the Hugging Face folder's ``files``, each cold (``prepare``)."""
    rows = []
    fst = version("fastsafetensors")
    for direct in (True, False):
        name = f"fastsafetensors {'direct' if direct else 'buffered'} t={PEER_THREADS} [hf]"

        def fastsafetensors(out: str, direct: bool = direct) -> dict[str, Any]:
            from fastsafetensors import SafeTensorsFileLoader

            # O_DIRECT or not is its environment variable (0.5 reads every local file with O_DIRECT
            # unless it is "0"; disable_cache only keeps its own cache of shuffled tensors)
            before = os.environ.get(_FST_ODIRECT)
            os.environ[_FST_ODIRECT] = "1" if direct else "0"
            loader = SafeTensorsFileLoader(None, device="cpu", nogds=True, set_numa=False, max_threads=PEER_THREADS)
            try:
                loader.add_filenames({0: files})
                buffers = loader.copy_files_to_device()
                tensors = {k: buffers.get_tensor(k) for k in loader.get_keys()}
                buffers.close()
            finally:
                loader.close()
                if before is None:
                    os.environ.pop(_FST_ODIRECT, None)
                else:
                    os.environ[_FST_ODIRECT] = before
            return {"tensors": len(tensors), "version": fst}

        rows.append(
            Case(
                name=name,
                family=f"fastsafetensors {'direct' if direct else 'buffered'}",
                procs=PEER_THREADS,
                run=fastsafetensors,
                prepare=prepare,
                baseline=baseline,
                limit=limit,
                core=False,
                unavailable=None if fst else "fastsafetensors is not installed (pip install '.[bench]')",
            )
        )
    runai = version("runai-model-streamer")

    def streamer(out: str) -> dict[str, Any]:
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as stream:
            stream.stream_files(files)
            tensors = dict(stream.get_tensors())
        return {"tensors": len(tensors), "version": runai}

    rows.append(
        Case(
            name="Run:ai streamer (defaults) [hf]",
            family="Run:ai streamer",
            procs=PEER_THREADS,
            run=streamer,
            prepare=prepare,
            baseline=baseline,
            limit=limit,
            core=False,
            unavailable=None if runai else "runai-model-streamer is not installed (pip install '.[bench]')",
        )
    )
    return rows


def plain_rows(tag: str, n: int) -> list[str]:
    """The plain reads of a copy at ``n`` workers: a file per thread (xN), and the loader's queue
    of 1 MiB requests (its readers), each direct and buffered."""
    queued = n * SPAN_REQUESTS_PER_THREAD
    return [
        f"plain read {kind} [{tag}]"
        for kind in (f"x{n} direct", f"x{n} buffered", f"{queued}x1M direct", f"{queued}x1M buffered")
    ]


def fresh_row(tag: str, n: int) -> str:
    """The loader's queued direct read into fresh memory (one new mapping of all the bytes)."""
    return f"plain read {n * SPAN_REQUESTS_PER_THREAD}x1M direct into fresh memory [{tag}]"


def limit_rows(tag: str, files: list[str], n: int, prepare: Callable[[], bool]) -> list[Case]:
    """The rows a copy's reads are held to (fio, the plain reads of :func:`plain_rows`) and the
    queued read into fresh memory beside them, each cold (``prepare``)."""
    fio = shutil.which("fio") is not None
    queued = n * SPAN_REQUESTS_PER_THREAD
    return [
        Case(
            name=f"fio direct x{n} [{tag}]",
            family="fio read",
            procs=n,
            run=fio_read(files, n),
            prepare=prepare,
            core=False,
            unavailable=None if fio else "fio is not on PATH",
        ),
        *(
            Case(name=f"plain read {kind} [{tag}]", family=family, procs=n, run=run, prepare=prepare)
            for mode in ("direct", "buffered")
            for kind, family, run in (
                (f"x{n} {mode}", f"plain read {mode}", plain_read(files, n, mode == "direct")),
                (
                    f"{queued}x1M {mode}",
                    f"queued read {mode}",
                    queued_read(files, queued, REQUEST_BYTES, mode == "direct"),
                ),
            )
        ),
        Case(  # not a limit: what a reader that hands out new memory can reach (its pages faulted in)
            name=fresh_row(tag, n),
            family="queued read direct fresh",
            procs=n,
            run=queued_read(files, queued, REQUEST_BYTES, True, fresh=True),
            prepare=prepare,
        ),
    ]
