"""A byte-counting progress bar on stderr that stays silent when off or not on a terminal."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]


class Progress:
    """``with Progress(total, enabled=...) as bar: bar.update(n)``; tqdm when shown, else nothing."""

    def __init__(self, *, total: int, enabled: bool, desc: str) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.close()

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)
