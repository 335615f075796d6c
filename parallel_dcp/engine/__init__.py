"""The engine: generic machinery that knows no checkpoint format and no storage.

- :mod:`~parallel_dcp.engine.partition`: disjoint tasks balanced by bytes (how keys are split up).
- :mod:`~parallel_dcp.engine.chunks`: row ranges of one huge tensor, written by different tasks.
- :mod:`~parallel_dcp.engine.memory`: the memory governor: cost model, admission, watchdog.
- :mod:`~parallel_dcp.engine.pool`: forked worker processes that run tasks and explain failures.
- :mod:`~parallel_dcp.engine.threads`: writer threads with the pool's interface.
- :mod:`~parallel_dcp.engine.progress`: the byte counter workers feed and the bar it drives.
"""
