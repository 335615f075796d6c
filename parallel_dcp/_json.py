"""JSON read from files someone else may have written (configs, indexes, records, headers).

``json.loads`` recurses once per nesting level, so ``[[[[...]]]]`` a few thousand levels deep
(a 4 KB lock record, a 200 KB config.json) raises ``RecursionError``: not a ``ValueError``, so it
escaped every "not JSON" check as a traceback. :func:`loads_json` makes it the ``ValueError``
(a ``json.JSONDecodeError``) those checks expect.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads_json"]


def loads_json(data: str | bytes | bytearray) -> Any:
    """``json.loads(data)``; nesting too deep to parse is a ``json.JSONDecodeError`` too."""
    try:
        return json.loads(data)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to parse (not a file this tool reads)", "", 0) from None
