"""What each pass of a Saver's layout check costs on `synthetic.many_small(50000)`, alone: over all 50,000 tensors
after 64 MiB were written (the state dict cold, as after a training step), and within one 512-tensor chunk read
just before (hot: the instructions alone). The cold figure over the hot one is the memory's share: each pass reads
each tensor's object, its TensorImpl and (for `data_ptr`) its StorageImpl, spread over the heap. Medians of 9.

Usage: flock LOCK python bench/bench_layout_check_floor.py
"""

import statistics
import time
import warnings
from types import SimpleNamespace

import torch

from parallel_dcp import _compat
from parallel_dcp.formats.nesting import leaves, skeleton
from parallel_dcp.jobs import plan_reuse
from parallel_dcp.synthetic import many_small

warnings.filterwarnings("ignore")
state_dict = many_small(50000)
shape = skeleton(state_dict)
assert shape is not None
found = leaves(shape, state_dict)
assert found is not None
tensors = [leaf for leaf in found if isinstance(leaf, torch.Tensor)]
guard = _compat.layout_guard(tensors, [t.shape for t in tensors], [t.stride() for t in tensors])
assert guard is not None
CHUNK = guard.chunk
junk = torch.zeros(64 << 20, dtype=torch.uint8)


# What _chunked reads of a kept layout: its tensors' types and its guard.
kept = SimpleNamespace(layout=SimpleNamespace(types=list(map(type, tensors))), guard=guard)


def median_ms(run, cold: bool) -> float:
    seconds = []
    for _ in range(9):
        if cold:
            junk.add_(1)
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds) * 1e3


address = torch.Tensor.data_ptr
part = tensors[:CHUNK]
scale = len(tensors) / CHUNK
passes = {
    "nesting walk (formats.nesting.leaves)": (lambda: leaves(shape, state_dict), None),
    "types (map(type))": (lambda: list(map(type, tensors)), lambda: list(map(type, part))),
    "addresses (Tensor.data_ptr)": (lambda: list(map(address, tensors)), lambda: list(map(address, part))),
    "guard (TensorGuards)": (lambda: guard(tensors), lambda: guard.part(tensors, 0)),
    "the three, chunk by chunk (plan_reuse._chunked)": (
        lambda: plan_reuse._chunked(kept, tensors, guard_now=True),  # type: ignore[arg-type]
        None,
    ),
}
print(f"{len(tensors):,} tensors, chunks of {CHUNK}")
for name, (whole, chunk) in passes.items():
    cold = median_ms(whole, cold=True)
    line = f"  {name:50s} cold {cold:7.2f} ms ({cold * 1e3 / len(tensors):.3f} us a tensor)"
    if chunk is not None:
        chunk()  # read just before: the chunk's objects in the cache
        hot = median_ms(chunk, cold=False) * scale
        line += f", hot within a chunk {hot:6.2f} ms (x{len(tensors) / CHUNK:.0f} chunks)"
    print(line, flush=True)
