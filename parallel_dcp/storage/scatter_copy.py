"""Many small copies inside this process in one system call, without holding the GIL.

Filling 50,000 small tensors from a read buffer costs one ``ctypes.memmove`` each: a Python call,
and a handoff of the GIL per copy, so two reading threads copy no faster than one. Linux's
``process_vm_writev`` aimed at this very process copies a whole list of (source, target) pairs in
one call (up to IOV_MAX pairs), and ctypes releases the GIL around it: the other thread's Python
runs meanwhile.

    sources, targets, lengths (numpy columns)
      │ pieces of at most _IOV_MAX pairs: one process_vm_writev(getpid(), ...) each
      │   (a short or failed call: that piece again, one memmove per pair)
      ▼
    copied

Where the kernel refuses the call (not Linux, seccomp, ENOSYS/EPERM), every copy is a memmove,
from the first refusal on (remembered for the process).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Any

import numpy

__all__ = ["scatter_copy", "scatter_copy_available"]

_IOV_MAX = 1024  # Linux's UIO_MAXIOV: the most pairs one call takes
_IOVEC = numpy.dtype([("base", numpy.uint64), ("len", numpy.uint64)])
_call: list[Any] = []  # [the bound libc function] once found usable, [None] once refused


def _writev() -> Any:
    if not _call:
        function = None
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).process_vm_writev
                function.restype = ctypes.c_ssize_t
                function.argtypes = [
                    ctypes.c_int,
                    ctypes.c_void_p,
                    ctypes.c_ulong,
                    ctypes.c_void_p,
                    ctypes.c_ulong,
                    ctypes.c_ulong,
                ]
            except (OSError, AttributeError):
                function = None
        _call.append(function)
    return _call[0]


def scatter_copy_available() -> bool:
    """Whether copies go through process_vm_writev (False: one memmove each)."""
    return _writev() is not None


def scatter_copy(sources: numpy.ndarray[Any, Any], targets: numpy.ndarray[Any, Any], lengths: Any) -> None:
    """Copy ``lengths[i]`` bytes from address ``sources[i]`` to address ``targets[i]`` for every
    ``i`` (int64 columns; ``lengths`` may also be one int for all), all in this process's memory.
    The ranges must be valid and no target may overlap another or a source (the caller's tensors
    and its read buffer)."""
    count = len(sources)
    if not count:
        return
    sizes = numpy.broadcast_to(numpy.asarray(lengths, dtype=numpy.int64), (count,))
    function = _writev()
    pid = os.getpid()
    for first in range(0, count, _IOV_MAX):
        stop = min(first + _IOV_MAX, count)
        if function is not None:
            local = numpy.empty(stop - first, dtype=_IOVEC)
            remote = numpy.empty(stop - first, dtype=_IOVEC)
            local["base"] = sources[first:stop]
            remote["base"] = targets[first:stop]
            local["len"] = remote["len"] = sizes[first:stop]
            want = int(sizes[first:stop].sum())
            done = function(pid, local.ctypes.data, stop - first, remote.ctypes.data, stop - first, 0)
            if done == want:
                continue
            if done < 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # refused here: memmove from now on
                _call[0] = function = None
        for source, target, size in zip(  # the piece again (copying a byte twice gives the same byte)
            sources[first:stop].tolist(), targets[first:stop].tolist(), sizes[first:stop].tolist(), strict=True
        ):
            if size:
                ctypes.memmove(target, source, size)
