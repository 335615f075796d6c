"""What the coordinator of a :class:`~parallel_dcp.engine.pool.WorkerPool` sends its workers
besides plain tasks, ``gc_paused``, which both sides use around their pickles, and how a result's
large bytes travel back (:func:`pickled_result`). (Kept apart from engine/pool.py, whose failure
handling is long enough on its own.)"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import mmap
import os
import pickle
import socket
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.remote_memory import RemoteBytes

__all__ = [
    "Ahead",
    "NewHandler",
    "TaskPart",
    "gc_paused",
    "pickled_result",
    "read_buffers",
    "receive_reply",
    "send_buffers",
]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside: building many objects (a task's metadata for 6,000 keys)
    otherwise triggers collections that walk the caller's whole heap, a 15x slowdown when the
    caller holds a state dict of 50,000 tensors."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True, slots=True)
class NewHandler:
    """Sent before a worker's first task of a run that brings its own handler: the pickled
    handler lies in the coordinator's memory, and the worker copies it out (remote_memory), so
    the coordinator sends each worker a few bytes, however large the job."""

    pickled: RemoteBytes

    def __reduce__(self) -> tuple[Any, ...]:
        return (NewHandler, (self.pickled,))  # (as RemoteBytes.__reduce__: not through copyreg)


@dataclass(frozen=True, slots=True)
class Ahead:
    """A task sent to a worker that is still busy with its previous one (``WorkerPool.run(handler=)``):
    the pickled task lies in the coordinator's memory until the worker has replied for it, and
    the worker copies it out when it takes it, so the coordinator never blocks on a pipe the
    worker is not reading (a part of thousands of keys does not fit a pipe's buffer)."""

    pickled: RemoteBytes

    def __reduce__(self) -> tuple[Any, ...]:
        return (Ahead, (self.pickled,))  # (as RemoteBytes.__reduce__: not through copyreg)

    def load(self) -> Any:
        data = self.pickled.fetch()
        with gc_paused():
            return pickle.loads(data)


@dataclass(frozen=True, slots=True)
class TaskPart:
    """A task with the part of the job only it needs (``WorkerPool.run(parts=)``): the worker runs
    ``handler.with_part(part, task)(task)``, so a handler that outlives one job is sent without the
    job's per-key data and each worker receives only its own tasks' keys."""

    task: Task
    part: Any
    # ``task`` pickled, where the pool kept it from an earlier run of the same tasks (a Saver's
    # saves of one layout): pickled in its place, so that its keys (thousands of strings) are not
    # pickled again by the coordinator at every save. The worker gets the task; this is None there.
    pickled_task: bytes | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        if self.pickled_task is None:
            return (TaskPart, (self.task, self.part))
        return (_task_part, (self.pickled_task, self.part))


def _task_part(pickled_task: bytes, part: Any) -> TaskPart:
    """A :class:`TaskPart` unpickled from its task's kept pickle (``TaskPart.__reduce__``)."""
    with gc_paused():
        task = pickle.loads(pickled_task)
    return TaskPart(task, part)


# Buffers of a result that add up to less than this travel in its pickle: mapping a memory file
# costs the coordinator ~0.16 ms a result whatever its size (the descriptor's socket and recvmsg,
# fstat, mmap; measured cold on a Saver's later save cut into 64 tasks), and copying bytes in band
# ~0.9 ms a MB: a task of an LLM-like dict sends ~1 KB of runs, one of 50,000 small keys on 64
# workers ~230 KB.
INLINE_RESULT_BYTES = 64 * 1024


def pickled_result(value: Any) -> tuple[bytes, list[int], int | None]:
    """``value`` pickled, the sizes of the bytes it wraps in :class:`pickle.PickleBuffer` (a task's
    pickled ``.metadata`` runs and side-index columns: jobs/dcp_commit.py), and those bytes written
    into a new anonymous memory file (its descriptor; None without any), which :func:`send_buffers`
    passes to the coordinator to map. Pickled in band, the 15 MB of runs of 50,000 keys cost the
    coordinator ~13 ms (read from the pipe, copied out of the reply, then out of the result); read
    raw from the pipe into one buffer, still ~8 ms; mapped, ~0.6 ms. The file has no name: nothing
    is left behind whichever process dies, and its memory goes with its last descriptor or mapping.
    Buffers of less than ``INLINE_RESULT_BYTES`` in all stay in the pickle (no file: the
    coordinator gets bytes, not views).
    """
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    views = [buffer.raw() for buffer in buffers]
    if not views:
        return data, [], None
    if sum(view.nbytes for view in views) < INLINE_RESULT_BYTES:
        del views, buffers
        return pickle.dumps(value, protocol=5), [], None
    fd = os.memfd_create("parallel_dcp-result", os.MFD_CLOEXEC)
    try:
        for view in views:
            while view:
                view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return data, [len(view) for view in views], fd


def send_buffers(conn_fd: int, shared: int | None, *, sent: bool) -> None:
    """In the worker, right after its reply (``sent``: an "ok" one, with :func:`pickled_result`'s
    sizes): pass the memory file ``shared`` over the pipe (``SCM_RIGHTS``); close it either way."""
    if shared is None:
        return
    try:
        if sent:
            with _socket(conn_fd) as sock:
                socket.send_fds(sock, [b"\0"], [shared])
    finally:
        os.close(shared)


def receive_reply(conn: Any) -> tuple[Any, list[memoryview]]:
    """In the coordinator: a worker's reply (a pickled tuple; an "ok" one's last field the sizes of
    its buffers), and those buffers (:func:`read_buffers`), taken before anything else is read."""
    data = conn.recv_bytes()
    with gc_paused():
        reply = pickle.loads(data)
    return reply, read_buffers(conn.fileno(), reply[-1]) if reply[0] == "ok" else []


def read_buffers(conn_fd: int, sizes: Sequence[int]) -> list[memoryview]:
    """In the coordinator: the buffers a worker sent behind its reply (:func:`send_buffers`), as
    read-only views of its memory file, mapped (no copy: the bytes are read where the worker wrote
    them, when ``.metadata`` is hashed and written).

    Raises:
        EOFError: the worker died before it sent them, or sent a file of another size."""
    total = sum(sizes)
    if not sizes:
        return []
    with _socket(conn_fd) as sock:
        data, fds, flags, _ = socket.recv_fds(sock, 1, 1, socket.MSG_CMSG_CLOEXEC)
    try:
        if data and flags & socket.MSG_CTRUNC:  # the kernel dropped the descriptor: none free here
            raise RuntimeError("the coordinator could not take a worker's result: it has no file descriptor free")
        if not data or len(fds) != 1 or os.fstat(fds[0]).st_size != total:
            raise EOFError("the worker's pipe closed in the middle of its result")
        whole = _mapped(fds[0], total) if total else memoryview(b"")
    finally:
        for fd in fds:
            os.close(fd)
    views: list[memoryview] = []
    at = 0
    for size in sizes:
        views.append(whole[at : at + size])
        at += size
    return views


def _socket(conn_fd: int) -> socket.socket:
    """A socket object on a copy of the pipe's descriptor (closed with it), blocking as the pipe
    is (a program's ``socket.setdefaulttimeout`` would otherwise make the shared file non-blocking)."""
    sock = socket.socket(fileno=os.dup(conn_fd))
    sock.setblocking(True)
    return sock


# Every page mapped at once: the memory governor (engine/process_memory.py) charges a process the
# shared-memory pages it maps, and a result's pages, in no process's memory once the worker has
# sent them, must be charged to the coordinator from the moment it holds them, not first when the
# commit reads them. (One call, too, where reading them faults each few pages in.)
_SHARED_NOW = mmap.MAP_SHARED | mmap.MAP_POPULATE


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _mapped(fd: int, size: int) -> memoryview:
    """``fd``'s first ``size`` bytes mapped read-only and shared, unmapped when the last view of
    them goes. (Not ``mmap.mmap``: it keeps a copy of the descriptor open while mapped, one per
    result until the commit, and a save of thousands of tasks would run out of descriptors.)"""
    libc = _libc()
    address = libc.mmap(None, size, mmap.PROT_READ, _SHARED_NOW, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:  # MAP_FAILED
        error = ctypes.get_errno()
        raise OSError(error, f"cannot map a worker's result: {os.strerror(error)}")
    # An array type of the next power of two, made once, not one of ``size`` made per result
    # (~15-50 us each). Only the first ``size`` bytes, mapped, are ever viewed.
    area = _area_type(max(1, size - 1).bit_length()).from_address(address)
    weakref.finalize(area, libc.munmap, address, size).atexit = False  # the process's end unmaps it
    return memoryview(area).cast("B")[:size].toreadonly()


@functools.cache
def _area_type(bits: int) -> Any:
    """``c_char * 2**bits``: the type of a mapped result of at most ``2**bits`` bytes (_mapped)."""
    return ctypes.c_char * (1 << bits)
