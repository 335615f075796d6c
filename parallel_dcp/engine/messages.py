"""What the coordinator of a :class:`~parallel_dcp.engine.pool.WorkerPool` sends its workers
besides plain tasks, ``gc_paused``, which both sides use around their pickles, and how a result's
large bytes travel back (:func:`pickled_result`). (Kept apart from engine/pool.py, whose failure
handling is long enough on its own.)

Longer than 300 lines because a reply's framing is written and read here on both sides (the
worker's one ``sendmsg`` of reply and memory file, the coordinator's exact reads of it): split,
the two halves of one wire format would live apart."""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import gc
import mmap
import os
import pickle
import socket
import struct
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.remote_memory import RemoteBytes
from parallel_dcp.engine.result_region import ResultNotMapped, ResultRegion, mapping_libc

__all__ = [
    "Ahead",
    "NewHandler",
    "PartAt",
    "TaskPart",
    "gc_paused",
    "pickled_result",
    "receive_reply",
    "send_reply",
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


@dataclass(frozen=True, slots=True)
class PartAt:
    """A :class:`TaskPart` whose part is bytes, sent as where its two pickles lie in the coordinator:
    the task's kept pickle and its part, which the coordinator holds, unchanged, until the worker
    has replied for the task. The worker copies both out when it takes it (remote_memory), so the
    coordinator neither pickles nor copies a part of thousands of keys per task: pickled into the
    message and copied again into a buffer to send ahead, ~0.13 ms a task (a save of 50,000 keys
    cut into 64 tasks); and a message this small never blocks on a pipe the worker is not reading."""

    task: RemoteBytes
    part: RemoteBytes

    def __reduce__(self) -> tuple[Any, ...]:
        return (PartAt, (self.task, self.part))  # (as RemoteBytes.__reduce__: not through copyreg)

    def load(self) -> TaskPart:
        return _task_part(self.task.fetch(), self.part.fetch())


def _task_part(pickled_task: bytes | bytearray, part: Any) -> TaskPart:
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
    into a new anonymous memory file (its descriptor; None without any), which :func:`send_reply`
    passes to the coordinator with the reply, to map. Pickled in band, the 15 MB of runs of 50,000 keys cost the
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


def send_reply(conn: Any, data: bytes, shared: int | None) -> None:
    """In the worker: its pickled reply ``data``, framed as ``Connection.send_bytes`` frames it, with
    the memory file ``shared`` (:func:`pickled_result`'s; None: none) passed beside its first byte
    (``SCM_RIGHTS``), so that the coordinator gets both from one read and never waits between them:
    sent after the reply, the file cost it a blocking ``recvmsg`` a result, 0.4-0.8 ms of wall time
    on a Saver's save of 50,000 keys cut into 64 tasks on 2 shared cores (the worker descheduled
    between its two sends). ``shared`` is closed either way."""
    if shared is None:
        conn.send_bytes(data)
        return
    try:
        framed = _frame_head(len(data)) + data
        with _socket(conn.fileno()) as sock:
            sent = socket.send_fds(sock, [framed], [shared])
            if sent < len(framed):  # (a stream socket may take part of it: the rest follows, no file)
                sock.sendall(memoryview(framed)[sent:])
    finally:
        os.close(shared)


def _frame_head(size: int) -> bytes:
    """``Connection.send_bytes``'s header for a message of ``size`` bytes."""
    return _SIZE.pack(size) if size <= 0x7FFFFFFF else _SIZE.pack(-1) + _LONG_SIZE.pack(size)


_SIZE = struct.Struct("!i")
_LONG_SIZE = struct.Struct("!Q")
# Room for one descriptor's control message: a reply carries at most one memory file.
_ONE_FD = socket.CMSG_SPACE(_SIZE.size)


def receive_reply(conn: Any, region: ResultRegion | None = None) -> tuple[Any, list[memoryview]]:
    """In the coordinator: a worker's reply (a pickled tuple; an "ok" one's last field the sizes of
    its buffers), and those buffers, mapped from the memory file that came with it (:func:`send_reply`):
    into ``region`` (a run's results side by side, engine/result_region.py), else on their own.

    Raises:
        EOFError: the worker's pipe closed before the whole reply (it died), or a reply whose
            buffers came without their file."""
    with _socket(conn.fileno()) as sock:
        head, fds = _read_head(sock)
        try:
            size = _SIZE.unpack(head)[0]
            if size == -1:
                size = _LONG_SIZE.unpack(_read_exactly(sock, _LONG_SIZE.size))[0]
            data = _read_exactly(sock, size)
            with gc_paused():
                reply = pickle.loads(data)
            sizes = reply[-1] if reply[0] == "ok" else []
            return reply, _map_buffers(fds, sizes, region)
        finally:
            for fd in fds:
                os.close(fd)


def _read_head(sock: socket.socket) -> tuple[bytes, list[int]]:
    """A message's first 4 bytes, and the descriptors passed beside them (taken, to be closed)."""
    head = b""
    fds: list[int] = []
    try:
        while len(head) < _SIZE.size:
            data, ancillary, flags, _ = sock.recvmsg(_SIZE.size - len(head), _ONE_FD, socket.MSG_CMSG_CLOEXEC)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
            if flags & socket.MSG_CTRUNC:  # the kernel dropped a descriptor: none free here
                raise RuntimeError("the coordinator could not take a worker's result: it has no file descriptor free")
            if not data:
                raise EOFError("the worker's pipe closed")
            head += data
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return head, fds


def _read_exactly(sock: socket.socket, size: int) -> bytearray:
    """The next ``size`` bytes of the pipe (no more: the next message stays in it)."""
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the worker's pipe closed in the middle of its reply")
        got += n
    return data


def _map_buffers(fds: Sequence[int], sizes: Sequence[int], region: ResultRegion | None = None) -> list[memoryview]:
    """The buffers a reply's ``sizes`` describe, as read-only views of the memory file ``fds[0]``,
    mapped (no copy: the bytes are read where the worker wrote them, when ``.metadata`` is hashed
    and written); the descriptors are the caller's to close.

    Raises:
        EOFError: buffers without a file, or a file of another size than theirs."""
    if not sizes:
        return []
    total = sum(sizes)
    if len(fds) != 1 or os.fstat(fds[0]).st_size != total:
        raise EOFError("the worker's result came without its memory file, or with one of another size")
    whole = region.map(fds[0], total) if region is not None and total else None
    if whole is None:
        whole = _mapped(fds[0], total) if total else memoryview(b"")
    views: list[memoryview] = []
    at = 0
    for size in sizes:
        views.append(whole[at : at + size])
        at += size
    return views


def _socket(conn_fd: int) -> contextlib.AbstractContextManager[socket.socket]:
    """A socket object on the pipe's own descriptor, detached (not closed) on leaving: no copy of
    the descriptor to make and close a message, and none left open that would keep the pipe open.
    Blocking as the pipe is: a program's ``socket.setdefaulttimeout`` makes a new socket object
    non-blocking, and the pipe's descriptor with it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, conn_fd)
    if socket.getdefaulttimeout() is not None:
        sock.setblocking(True)
    return _detached(sock)


@contextlib.contextmanager
def _detached(sock: socket.socket) -> Iterator[socket.socket]:
    try:
        yield sock
    finally:
        sock.detach()


# Every page mapped at once: the memory governor (engine/process_memory.py) charges a process the
# shared-memory pages it maps, and a result's pages, in no process's memory once the worker has
# sent them, must be charged to the coordinator from the moment it holds them, not first when the
# commit reads them. (One call, too, where reading them faults each few pages in.)
_SHARED_NOW = mmap.MAP_SHARED | mmap.MAP_POPULATE


def _mapped(fd: int, size: int) -> memoryview:
    """``fd``'s first ``size`` bytes mapped read-only and shared, unmapped when the last view of
    them goes. (Not ``mmap.mmap``: it keeps a copy of the descriptor open while mapped, one per
    result until the commit, and a save of thousands of tasks would run out of descriptors.)"""
    libc = mapping_libc()
    address = libc.mmap(None, size, mmap.PROT_READ, _SHARED_NOW, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:  # MAP_FAILED
        error = ctypes.get_errno()
        raise ResultNotMapped(error)
    # An array type of the next power of two, made once, not one of ``size`` made per result
    # (~15-50 us each). Only the first ``size`` bytes, mapped, are ever viewed.
    area = _area_type(max(1, size - 1).bit_length()).from_address(address)
    weakref.finalize(area, libc.munmap, address, size).atexit = False  # the process's end unmaps it
    return memoryview(area).cast("B")[:size].toreadonly()


@functools.cache
def _area_type(bits: int) -> Any:
    """``c_char * 2**bits``: the type of a mapped result of at most ``2**bits`` bytes (_mapped)."""
    return ctypes.c_char * (1 << bits)
