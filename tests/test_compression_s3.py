"""Compressed records on object storage (moto S3): uploaded and read through the same bounded paths."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from parallel_dcp.storage.location import locate
from parallel_dcp.storage.metadata import read_metadata
from tests.conftest import assert_same, empty_like_state
from tests.s3_server import moto_endpoint

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def options() -> Iterator[dict[str, Any]]:
    with moto_endpoint() as url:
        yield {"endpoint_url": url}


@pytest.fixture
def bucket(options: dict[str, Any]) -> str:
    import s3fs

    name = f"pdcp-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(name)
    return name


def test_compressed_save_load_convert_verify_on_s3(bucket: str, options: dict[str, Any], tmp_path: Any) -> None:
    g = torch.Generator().manual_seed(0)
    sd = {
        "embed": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "zeros": torch.zeros(300, 300),
        "ids": torch.arange(1000),
        "step": 12,
    }
    url = f"s3://{bucket}/ckpt"
    parallel_dcp.save(sd, url, workers=2, executor="processes", storage_options=options, compress="zstd:3")
    infos = (read_metadata(locate(url, options)).storage_data or {}).values()
    assert infos and all(list(i.transform_descriptors) == ["stream.zstd/1"] for i in infos)
    stats = parallel_dcp.ReadStats()
    assert_same(parallel_dcp.load(url, workers=2, storage_options=options, stats=stats), sd)
    assert stats.compressed == 3
    assert_same(parallel_dcp.load(url, workers=2, retries=1, storage_options=options), sd)
    assert parallel_dcp.verify(url, storage_options=options).ok
    info = parallel_dcp.inspect(url, storage_options=options)
    assert info["compressed_records"] == info["records"] and info["ratio"] < 0.8
    # S3 -> local compressed DCP (ranged reads of the compressed source, compressed again) -> stock load
    local = tmp_path / "local"
    parallel_dcp.convert(url, local, workers=2, storage_options=options, compress="zstd:1", chunk_size="64KiB")
    target = empty_like_state(sd)
    dcp.load(target, checkpoint_id=str(local), no_dist=True)
    assert_same(target, sd)
