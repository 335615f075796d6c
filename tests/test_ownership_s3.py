"""Object storage has no lock and no rename: a failed save deletes only the names it created, and
an overwrite keeps every object the replaced checkpoint did not own (moto server, as in
tests/test_object_storage.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp.errors import WorkerError
from tests.conftest import assert_same
from tests.faults import PutObjectInWorker
from tests.test_object_storage import _state, bucket, endpoint, options, s3  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(240)


def _objects(store: Any, prefix: str) -> dict[str, bytes]:
    store.invalidate_cache()
    return {key: store.cat_file(key) for key in sorted(store.find(prefix, refresh=True))}


def test_a_failed_save_deletes_only_its_own_objects(
    s3: Any,  # noqa: F811
    bucket: str,  # noqa: F811
    options: dict[str, Any],  # noqa: F811
    endpoint: str,  # noqa: F811
) -> None:
    url = f"s3://{bucket}/run"
    parallel_dcp.save(_state(0), url, workers=2, storage_options=options)
    parallel_dcp.save(_state(1), f"{url}/nested", workers=2, storage_options=options)  # another committed save
    s3.pipe(f"{bucket}/run/notes.txt", b"someone's notes")
    before = _objects(s3, f"{bucket}/run")
    intruder = f"{bucket}/run/other-writer.bin"  # uploaded by another writer while the save runs
    bad = {"w": torch.ones(64), "hook": PutObjectInWorker(intruder, endpoint)}
    with pytest.raises(WorkerError, match="another writer"):
        parallel_dcp.save(bad, url, workers=2, executor="processes", overwrite=True, storage_options=options)
    assert _objects(s3, f"{bucket}/run") == before | {intruder: b"another writer"}
    assert_same(parallel_dcp.load(url, storage_options=options), _state(0))
    assert_same(parallel_dcp.load(f"{url}/nested", storage_options=options), _state(1))


def test_overwrite_keeps_objects_the_checkpoint_does_not_own(s3: Any, bucket: str, options: dict[str, Any]) -> None:  # noqa: F811
    url = f"s3://{bucket}/keep"
    parallel_dcp.save(_state(0), url, workers=2, storage_options=options)
    old_shards = {k for k in s3.ls(f"{bucket}/keep", refresh=True) if k.endswith(".distcp")}
    s3.pipe(f"{bucket}/keep/train_state.json", b'{"step": 7}')
    parallel_dcp.save(_state(3), url, workers=2, overwrite=True, storage_options=options)
    names = set(s3.ls(f"{bucket}/keep", refresh=True))
    assert not names & old_shards and f"{bucket}/keep/train_state.json" in names
    assert s3.cat_file(f"{bucket}/keep/train_state.json") == b'{"step": 7}'
    assert {n.rsplit("/", 1)[1] for n in names if not n.endswith(".distcp")} == {
        ".metadata",
        ".parallel_dcp.json",
        "train_state.json",
    }
    assert_same(parallel_dcp.load(url, storage_options=options), _state(3))
    assert parallel_dcp.verify(url, storage_options=options).ok
