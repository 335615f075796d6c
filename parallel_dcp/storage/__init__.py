"""Storage: where checkpoints live and how a job's output is committed there.

- :mod:`~parallel_dcp.storage.location`: local paths and fsspec URLs (``s3://...``) behind one interface.
- :mod:`~parallel_dcp.storage.staging`: the staging / commit / publish protocol of every destination.
- :mod:`~parallel_dcp.storage.writers`: DCP ``FileSystemWriter`` flavours that record what they write.
- :mod:`~parallel_dcp.storage.manifest`: the sidecar of sizes and xxh3 checksums.
- :mod:`~parallel_dcp.storage.metadata`: ``.metadata`` read without trusting it.
"""
