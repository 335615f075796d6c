"""The user-facing jobs, each a short composition of the one pipeline (plan -> stage -> run ->
commit -> publish) with a source format, a destination and the engine.

- :mod:`~parallel_dcp.jobs.pipeline`: the pipeline every write job (save, convert) runs.
- :mod:`~parallel_dcp.jobs.targets`: what an output is (DCP directory, sharded directory, file).
- :mod:`~parallel_dcp.convert`, :mod:`~parallel_dcp.jobs.load`, :mod:`~parallel_dcp.verify`,
  :mod:`~parallel_dcp.jobs.inspect`: the other jobs.
- :mod:`~parallel_dcp.jobs.distributed`: the same pipeline across the ranks of a torchrun/srun job.
- :mod:`~parallel_dcp.jobs.rename` (rename rules over a source), :mod:`~parallel_dcp.jobs.dryrun`
  (the pipeline's plan without the run), :mod:`~parallel_dcp.jobs.diff` (two checkpoints compared).
"""
