"""planner_data proven in bulk (storage/planner_bulk.py) accepts exactly what the per-path check
(geometry.check_planner_data) accepts, for mappings of tuples of names and indices; anything else
it leaves to the per-path check, whose refusal and message stand."""

from __future__ import annotations

import random
from typing import Any

import pytest

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.geometry import MAX_PATH_DEPTH, check_planner_data
from parallel_dcp.storage.metadata_check import check_metadata_fields
from parallel_dcp.storage.planner_bulk import bulk_planner_data

_PARTS: list[Any] = ["a", "b", "c", "0", 0, 1, 2, 5]
_ODD: list[Any] = [True, -1, 1.5, None, b"a", ("a",)]


def _per_path_accepts(planner_data: Any, keys: list[str]) -> bool:
    try:
        check_planner_data(planner_data, keys, "x")
    except (CorruptCheckpointError, TypeError):
        return False
    return True


def _random_mapping(rng: random.Random) -> tuple[dict[Any, Any], list[str]]:
    mapping: dict[Any, Any] = {}
    for i in range(rng.randint(1, 9)):
        path = [rng.choice(["a", "b", "c"])] + [rng.choice(_PARTS) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.1:
            path[rng.randrange(len(path))] = rng.choice(_ODD)
        mapping[f"k{i}"] = tuple(path) if rng.random() < 0.95 else path
    keys = list(mapping)
    if rng.random() < 0.05:
        keys.append("absent")
    return mapping, keys


def test_bulk_proves_exactly_what_the_per_path_check_accepts_on_fuzzed_mappings() -> None:
    rng = random.Random(32)
    proven = plain = refused = 0
    for _ in range(20000):
        mapping, keys = _random_mapping(rng)
        bulk = bulk_planner_data(mapping, keys, MAX_PATH_DEPTH)
        accepted = _per_path_accepts(mapping, keys)
        assert not bulk or accepted, mapping  # never proves what the per-path check refuses
        simple = all(type(p) is tuple and all(type(x) in (str, int) for x in p) for p in mapping.values())
        if simple and set(keys) <= set(mapping):
            assert bulk == accepted, mapping  # and proves every good one of the common shape
            plain += 1
        proven += bulk
        refused += not accepted
    assert proven > 2000 and refused > 2000 and plain > 10000  # both outcomes exercised


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"a": ("a", 0), "b": ("a", "x", "y")}, "both a dict and a list"),  # kinds differ across levels
        ({"a": ("a", "x"), "b": ("a", "x", "y")}, "has a level of the nesting"),
        ({"a": ("a", 1), "b": ("a", 1)}, "the same path"),
        ({"a": ("a", True)}, "non-negative list indices"),
        ({"a": ("a", -1)}, "non-negative list indices"),
        ({"a": (0, "a")}, "non-negative list indices"),
        ({"a": ("a", 10**6)}, "impossible nesting"),
        ({"a": ()}, "impossible path"),
        ({"a": ("a",) * (MAX_PATH_DEPTH + 1)}, "impossible path"),
    ],
)
def test_what_bulk_cannot_prove_is_refused_by_the_per_path_check_with_its_message(
    mapping: dict[str, Any], message: str
) -> None:
    assert not bulk_planner_data(mapping, list(mapping), MAX_PATH_DEPTH)
    with pytest.raises(CorruptCheckpointError, match=message):
        check_planner_data(mapping, list(mapping), "x")


def test_an_optimizer_state_of_many_keys_is_proven_in_bulk() -> None:
    mapping = {f"optimizer.state.{i}.{n}": ("optimizer", "state", str(i), n) for i in range(500) for n in "xy"}
    mapping |= {f"optimizer.param_groups.0.{n}": ("optimizer", "param_groups", 0, n) for n in ("lr", "params")}
    mapping |= {f"layers.{i}.w": ("layers", i, "w") for i in range(100)}
    assert bulk_planner_data(mapping, list(mapping), MAX_PATH_DEPTH)


def test_a_checkpoint_with_a_bad_nesting_is_still_refused_naming_the_key() -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    metadata = Metadata(
        state_dict_metadata={"a": BytesStorageMetadata(), "b": BytesStorageMetadata()},
        planner_data={"a": ("m", 0), "b": ("m", "x", "y")},
        storage_data={},
    )
    with pytest.raises(CorruptCheckpointError, match="both a dict and a list"):
        check_metadata_fields(metadata, "ckpt/.metadata")
