"""Reading another process's memory with ``process_vm_readv`` (Linux 3.2+): one copy, no pipe.

A worker started before the data exists (``parallel_dcp.Saver``) cannot read the coordinator's
tensors copy-on-write; it copies them straight out of the coordinator's address space instead,
with the GIL released for the whole copy (ctypes releases it around the call), so a busy Python
thread in the caller does not slow the copy down.

The kernel allows it where ptrace would be allowed: same user, and Yama's
``/proc/sys/kernel/yama/ptrace_scope`` 0 (or no Yama). Scope 1 allows only a process's
descendants, scope 2 and 3 no one; :func:`refusal` says why it cannot be used, before a job
relies on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["RemoteBytes", "StaleRead", "read_gathered", "read_into", "refusal"]

# The most iovecs one call takes (the kernel's UIO_MAXIOV).
_IOV_MAX = 1024
# One call copies at most this much, so that a partial copy (the kernel stops at a fault) is
# resumed where it stopped and a huge tensor does not pin one iovec the whole time.
_PIECE = 256 * 1024 * 1024


class StaleRead(OSError):
    """The bytes are not (all) mapped at that address in the other process any more (EFAULT, or a
    copy that stopped short): what it held there was freed or moved. An OSError, so code that
    catches those still does; a pool reports it as a stale plan (``errors.StalePlan``)."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.cache
def _readv() -> Any:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    if libc is None or not hasattr(libc, "process_vm_readv"):
        return None
    call = libc.process_vm_readv
    call.restype = ctypes.c_ssize_t
    call.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return call


def read_into(pid: int, address: int, nbytes: int, destination: int) -> None:
    """Copy ``nbytes`` at ``address`` in process ``pid`` to ``destination`` in this process.

    Raises:
        StaleRead: the range is not mapped there (EFAULT: the data was freed).
        OSError: the kernel refused (EPERM: see :func:`refusal`), the process is gone (ESRCH).
    """
    call = _readv()
    if call is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available in this C library")
    done = 0
    while done < nbytes:
        size = min(_PIECE, nbytes - done)
        local = _IoVec(destination + done, size)
        remote = _IoVec(address + done, size)
        got = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            code = ctypes.get_errno()
            stale = StaleRead if code == errno.EFAULT else OSError
            raise stale(code, f"process_vm_readv from pid {pid} at {address + done:#x}: {os.strerror(code)}")
        if got == 0:
            raise StaleRead(errno.EFAULT, f"process_vm_readv from pid {pid} copied nothing at {address + done:#x}")
        done += got


def read_gathered(pid: int, ranges: list[tuple[int, int]], destination: int) -> None:
    """Copy each (address, nbytes) of process ``pid``, in order, back to back from ``destination``:
    one call per 1,024 ranges (50,000 small tensors: 49 calls, not 50,000).

    Raises:
        OSError: as :func:`read_into`.
    """
    call = _readv()
    if call is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available in this C library")
    offset = 0
    for first in range(0, len(ranges), _IOV_MAX):
        group = [(address, size) for address, size in ranges[first : first + _IOV_MAX] if size]
        total = sum(size for _, size in group)
        if not group:
            continue
        if total > _PIECE:  # large ranges: one at a time, each resumed where a partial copy stopped
            for address, size in group:
                read_into(pid, address, size, destination + offset)
                offset += size
            continue
        local = _IoVec(destination + offset, total)
        remote = (_IoVec * len(group))(*(_IoVec(address, size) for address, size in group))
        got = call(pid, ctypes.byref(local), 1, remote, len(group), 0)
        if got < 0 and ctypes.get_errno() != errno.EFAULT:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        if got != total:  # stopped at a fault (or faulted at once): find which range, the plain way
            position = offset
            for address, size in group:
                read_into(pid, address, size, destination + position)
                position += size
        offset += total


@dataclass(frozen=True, slots=True)
class RemoteBytes:
    """Bytes held by process ``pid`` (which must keep them alive and unchanged until read)."""

    pid: int
    address: int
    length: int

    @classmethod
    def of(cls, data: bytes | bytearray) -> RemoteBytes:
        """Where ``data`` lies in this process (keep ``data`` alive, and a bytearray unchanged,
        while others read it). Bytes are not copied: their own buffer is read."""
        # The first byte's address: an array type made per length (c_char * n) costs ~15-50 us a
        # message sent ahead. A c_char_p made from bytes points into their buffer (no copy), read
        # back as a number (``ctypes.cast``: ~6 us, against ~1.5).
        if not data:
            address = 0
        elif isinstance(data, bytes):
            address = ctypes.c_size_t.from_buffer(ctypes.c_char_p(data)).value
        else:
            address = ctypes.addressof(ctypes.c_char.from_buffer(data))
        return cls(os.getpid(), address, len(data))

    def __reduce__(self) -> tuple[Any, ...]:
        # Its fields in a tuple: a frozen dataclass with slots otherwise pickles through copyreg's
        # Python code (~9 us hot, a message sent ahead, against ~1).
        return (RemoteBytes, (self.pid, self.address, self.length))

    def fetch(self) -> bytearray:
        out = bytearray(self.length)
        if self.length:
            read_into(self.pid, self.address, self.length, ctypes.addressof(ctypes.c_char.from_buffer(out)))
        return out


def refusal(data: RemoteBytes, expected: bytes) -> str | None:
    """None if this process reads ``expected`` from ``data``; else why not, in words."""
    try:
        got = data.fetch()
    except OSError as exc:
        scope = _ptrace_scope()
        why = f"process_vm_readv is refused ({os.strerror(exc.errno) if exc.errno else exc})"
        return why + (f"; kernel.yama.ptrace_scope is {scope}" if scope is not None else "")
    return None if got == expected else "process_vm_readv copied other bytes than the coordinator holds"


def _ptrace_scope() -> str | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as scope:
            return scope.read().strip()
    except OSError:
        return None
