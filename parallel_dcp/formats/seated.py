"""Fresh targets placed where the direct reader can fill them in place.

O_DIRECT reads whole pages of the file into whole pages of memory: a destination whose address
and file offset differ by a multiple of ALIGN takes the file's pages straight in, any other goes
through a bounce buffer and a copy (storage/direct_read.py). ``torch.empty`` puts a large tensor
64 bytes into a page, while a DCP record's bytes start anywhere in a page of the shard (after the
record's header), so a load into fresh tensors copied every byte once more and faulted in every
destination page from user space. Measured on this project's 2-core VM (dcpread3 notes): copying
2 GiB out of a reused buffer costs 0.25 s of CPU, into fresh memory 0.9 s (the kernel zeroing the
pages alone, MADV_POPULATE_WRITE: 0.58 s); a cold 2 GiB direct load took 1.02 s of CPU with every
byte bounced, 0.74 s with its tensors seated.

So a fresh tensor of a large record gets a ``room``: its bytes and one page more. Once the
record's header is parsed (its bytes' file offset known), :func:`seat` moves the tensor inside
its room (``Tensor.set_``: the same tensor object, the same storage) so that its address and its
file offset are equal modulo ALIGN. The page more is charged under the memory limit
(:func:`room_bytes`); the caller's tensors (``into=``) stay where they are.

Rooms are given only where the bounce buffers cannot be in huge pages (:func:`rooms`). In 2 MiB
pages a bounced 1 MiB read is one device request, while a read straight into a fresh tensor's
4 KiB pages is two on a virtio disk (254 segments a request), and the bounce's copy faults the
fresh pages in from user space in one pass. Measured on this VM (`bench/bench_fresh_load.py`,
`bench/fresh-load-run1.txt`: cold 2 GiB DCP load, w=2, 5 rounds alternating, quiet): seated
1.322 s, bounced 1.019 s for a process's second load, 1.628 s against 1.362 s for its first;
the same bytes. Giving fresh tensors huge pages instead (torch's ``THP_MEM_ALLOC_ENABLE=1``) was
slower: 3.02 s against 2.33 s for a first load.
"""

from __future__ import annotations

import ctypes
import math

import torch

from parallel_dcp.storage.direct_read import huge_pages
from parallel_dcp.storage.io_mode import ALIGN

__all__ = ["ROOM_MIN_BYTES", "fresh", "room_bytes", "rooms", "seat", "shift"]

# A tensor this large gets a room (smaller ones are whole small records, copied out of a batch).
ROOM_MIN_BYTES = 1 << 20


def rooms() -> bool:
    """Whether large fresh tensors get rooms: only where the bounce buffers are in 4 KiB pages."""
    return not huge_pages()


def room_bytes(nbytes: int) -> int:
    """What a fresh tensor of ``nbytes`` allocates: its room when it gets one."""
    return nbytes + ALIGN if nbytes > ROOM_MIN_BYTES and rooms() else nbytes


def fresh(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An empty tensor and, when it is large enough, its room (uint8, ALIGN bytes longer; the
    tensor starts at its first byte until :func:`seat` moves it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if room_bytes(nbytes) == nbytes:
        return torch.empty(shape, dtype=dtype), None
    room = torch.empty(room_bytes(nbytes), dtype=torch.uint8)
    tensor = torch.empty(0, dtype=dtype).set_(room.untyped_storage(), 0, shape, _strides(shape))
    return tensor, room


def seat(tensor: torch.Tensor, room: torch.Tensor, file_offset: int) -> int:
    """Move ``tensor`` (contiguous, in ``room``, not yet filled) to where its address equals
    ``file_offset`` (where its bytes start in the file) modulo ALIGN, and return its offset in
    ``room``. Where its bytes start at an offset no multiple of its element size (a shard's records
    lie one after the other, at any byte), the tensor cannot start there: it starts up to
    ``itemsize - 1`` bytes lower, and the returned offset, where the file's bytes must land, is that
    much higher: :func:`shift` then moves them down in place (their pages already faulted in by the
    read: one memmove, no bounce buffer)."""
    itemsize = tensor.element_size()
    landing = (file_offset - room.data_ptr()) % ALIGN
    start = landing - landing % itemsize
    tensor.set_(room.untyped_storage(), start // itemsize, tensor.shape, tensor.stride())
    return landing


def shift(tensor: torch.Tensor, room: torch.Tensor, landing: int) -> None:
    """The tensor's bytes, read into ``room`` at ``landing``, moved down to where it starts."""
    source = room.data_ptr() + landing
    if source != tensor.data_ptr():
        ctypes.memmove(tensor.data_ptr(), source, tensor.nbytes)  # overlapping: memmove, without the GIL


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))
