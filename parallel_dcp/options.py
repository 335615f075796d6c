"""The one validated set of options a job runs with; the API and the CLI only fill it in."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from parallel_dcp.engine.memory import default_limit, parse_size, warn_over_machine
from parallel_dcp.storage.compression import Compression, parse_compress
from parallel_dcp.storage.io_mode import check_io

__all__ = ["DEFAULT_SHARD_SIZE", "Options", "usable_cores"]

DEFAULT_SHARD_SIZE = 5 * 10**9  # largest shard of a sharded output: what Hugging Face's save_pretrained uses


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """Options of one save or load.

    Attributes:
        workers: worker processes; None means every usable core.
        overwrite: replace an existing checkpoint (atomically) instead of refusing.
        progress: show a progress bar on stderr.
        sync_files: fsync every shard and ``.metadata`` before the commit (as stock DCP does).
        crc32: compute the per-record CRC32 of ``torch.save`` zip records. No DCP reader checks
            it and it costs most of a save's time, so it is off; stock readers load either way.
        memory_limit: ceiling on the memory the job adds to its process tree, in bytes or as a
            string ("512MiB", "32GiB", "16GB"); None means half the memory available at start.
        retries: how often a task whose worker died (SIGKILL, segfault, exit) is run again.
        task_timeout: seconds one task may run before its worker is killed; None for no limit.
        chunk_size: DCP outputs split tensors larger than this (bytes or "1GiB") into chunks
            that different workers write; None derives it from the balanced share per worker
            and the memory limit (see :mod:`parallel_dcp.engine.chunks`).
        executor: ``"processes"`` (forked workers), ``"threads"`` (writer threads in the calling
            process; in-memory saves only) or ``"auto"``: threads for an in-memory state dict of
            large tensors (at least 1 MiB each on average) and plain values when neither
            ``retries`` nor ``task_timeout`` is asked for, processes otherwise. See
            :mod:`parallel_dcp.engine.threads`.
        distributed: run as one rank of a torch.distributed job (torchrun, srun): every rank runs
            its share of the tasks on its own pool; rank 0 commits (see
            :mod:`parallel_dcp.jobs.distributed`).
        dist_timeout: seconds a rank waits for the others at each step before failing.
        checksums: record each file's xxh3 checksum in the manifest (``verify`` then finds flipped
            bytes); sizes are recorded either way.
        resume: continue a conversion that died (killed, out of space, interrupted) in this
            destination with the same arguments: keep each finished task whose files still hash as
            recorded, redo the rest (see :mod:`parallel_dcp.jobs.resume`). Nothing to resume: a
            fresh run. Other arguments or a changed source: :class:`ResumeError`.
        compress: ``None`` (stored as is), ``"zstd"`` or ``"zstd:LEVEL"`` (1..22; default 3): DCP
            outputs store every record as one zstd frame, as stock DCP's ``ZStandard`` extension
            does, each record in the worker (thread or process) that writes it; needs the
            ``zstandard`` package (``pip install '.[zstd]'`` in a checkout).
        storage_options: fsspec options for paths that are URLs (``s3://...``), such as
            ``{"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "eu-west-1"}}``;
            credentials come from the standard AWS environment and config unless given here.
        io: how shard bytes reach local files: ``"direct"`` (O_DIRECT through aligned buffers,
            several writes in flight, no page cache), ``"buffered"`` (the page cache) or
            ``"auto"``: direct where the file system accepts O_DIRECT and is a real device, for
            files of at least 16 MiB; buffered on tmpfs, FUSE, network file systems and object
            storage (see :mod:`parallel_dcp.storage.io_mode`).
        check_source: a conversion checks the source files it reads whole against the checksums
            the source carries (see :mod:`parallel_dcp.jobs.source_check`), and the side files it
            copies against their folder's record (:mod:`parallel_dcp.jobs.side_file_checks`); False
            skips both.
    """

    workers: int | None = None
    overwrite: bool = False
    progress: bool = False
    sync_files: bool = True
    crc32: bool = False
    memory_limit: int | str | None = None
    retries: int = 0
    task_timeout: float | None = None
    checksums: bool = True
    chunk_size: int | str | None = None
    executor: str = "auto"
    distributed: bool = False
    dist_timeout: float = 1800.0
    storage_options: dict[str, Any] | None = None
    resume: bool = False
    compress: str | None = None
    io: str = "auto"
    check_source: bool = True

    def __post_init__(self) -> None:
        check_io(self.io)
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)):
            raise TypeError(f"workers must be an int or None, got {self.workers!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.memory_limit is not None:
            parse_size(self.memory_limit)
        if self.chunk_size is not None:
            parse_size(self.chunk_size, "chunk_size")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0 seconds, got {self.dist_timeout!r}")
        if self.executor not in ("auto", "processes", "threads"):
            raise ValueError(f"executor must be 'auto', 'processes' or 'threads', got {self.executor!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        if self.storage_options is not None and (
            not isinstance(self.storage_options, dict) or not all(isinstance(k, str) for k in self.storage_options)
        ):
            raise TypeError(f"storage_options must be a dict with string keys, got {self.storage_options!r}")
        if self.compress is not None:
            parse_compress(self.compress)  # a bad spec, or no zstandard, fails before anything runs
        if self.task_timeout is not None and not self.task_timeout > 0:
            raise ValueError(f"task_timeout must be > 0 seconds, got {self.task_timeout!r}")

    def compression(self) -> Compression | None:
        """``compress`` parsed (None: uncompressed)."""
        return parse_compress(self.compress)

    def memory_ceiling(self) -> int:
        """The memory limit in bytes, resolved now (the default depends on what is available)."""
        if self.memory_limit is None:
            return default_limit()
        limit = parse_size(self.memory_limit)
        warn_over_machine(limit)
        return limit

    def worker_count(self, tasks: int) -> int:
        """Workers to start for ``tasks`` tasks: never more than there are tasks."""
        wanted = self.workers if self.workers is not None else usable_cores()
        return max(1, min(wanted, tasks))
