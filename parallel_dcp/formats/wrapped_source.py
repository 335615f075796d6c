"""A source that reads through another one (dequantizing or quantizing on the way)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from parallel_dcp.formats.base import Source

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorProperties

__all__ = ["WrappedSource"]

_W = TypeVar("_W", bound="WrappedSource")


@dataclass
class WrappedSource(Source):
    """Reads go through ``inner``; what a subclass does not change is passed to it as is."""

    inner: Source | None = None

    @classmethod
    def around(cls: type[_W], source: Source, **fields: Any) -> _W:
        """A view of ``source`` under its name: path, kind, files (the folder and index they were
        chosen by) and options are the source's."""
        return cls(
            path=source.path,
            kind=source.kind,
            files=list(source.files),
            storage_options=source.storage_options,
            trust_pickle=source.trust_pickle,
            header_metadata=source.header_metadata,
            folder=source.folder,
            index=source.index,
            inner=source,
            **fields,
        )

    def _inner(self) -> Source:
        assert self.inner is not None
        return self.inner

    def close(self) -> None:
        self._inner().close()

    def load_values(self, keys: Iterable[str]) -> None:
        self._inner().load_values(keys)

    def value_bytes(self, key: str) -> int:
        return self._inner().value_bytes(key)

    def stated_properties(self) -> Callable[[str], TensorProperties | None] | None:
        """The inner source's, for the keys it holds under the same name (a computed scale: none)."""
        return self._inner().stated_properties()
