"""A job planned and its destination held, knowing what a resume keeps: the one place where the
write pipeline meets :mod:`parallel_dcp.jobs.resume`.

    stage_job ─┬─ fresh:  plan ── stage ── expect ── job record (a conversion to a local path)
               └─ resume: stage(resume) ── a dead conversion adopted? its recorded plan : plan
                            ── expect ── its done records checked, their files re-hashed: kept
    StagedJob ── job, tasks, workers, staging
               ├─ todo: the tasks still to run (all of them, unless a resume kept some)
               ├─ recorder: writes each task's done record in its worker (None: no records)
               ├─ values(ran): every task's result in task order (kept ones rebuilt from records,
               │  as their workers would have sent them)
               └─ fail(failure, writing): leave what a later resume can use, or remove it all

The pipeline plans, runs and commits the same way whether or not a resume kept anything: it
asks the staged job which tasks to run, what to record after each, and what to commit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import TaskResult, gc_paused
from parallel_dcp.jobs import resume
from parallel_dcp.jobs.source_check import plan_checks
from parallel_dcp.jobs.targets import Job, Target
from parallel_dcp.options import Options
from parallel_dcp.storage.protocol import Staging

__all__ = ["Planned", "StagedJob", "stage_job"]


class Planned(Protocol):
    """A job's plan: its units (chunks split), its tasks, the workers that run them, the split."""

    @property
    def job(self) -> Job: ...
    @property
    def tasks(self) -> list[Task]: ...
    @property
    def workers(self) -> int: ...
    @property
    def threshold(self) -> int: ...


Planner = Callable[[Job, Target, Options, MemoryGovernor], Planned]


@dataclass
class StagedJob:
    """A planned job whose destination is held, and what a resume kept of a dead conversion."""

    job: Job
    tasks: list[Task]
    workers: int
    staging: Staging
    target: Target
    # Tasks leave done records (a conversion to a local destination, on one node): a failure
    # while they run leaves the finished ones for a later resume.
    records: bool
    kept: resume.Kept
    recorder: resume.Recorder | None

    @property
    def resumed(self) -> bool:
        """True when this job continues a dead conversion (whatever it kept of it)."""
        return self.staging.resumed is not None

    @property
    def bytes_kept(self) -> int:
        return self.kept.bytes_kept

    @property
    def todo(self) -> list[Task]:
        """The tasks to run: every task whose files a resume did not keep."""
        return [task for task in self.tasks if task.index not in self.kept.results]

    def values(self, ran: Iterable[TaskResult[Any]]) -> list[Any]:
        """Every task's result in task order, as its worker sends it back (after
        :meth:`~parallel_dcp.jobs.targets.Target.outgoing`): those that ``ran``, and those a resume
        kept (rebuilt from their records, then made what their worker would have sent)."""
        kept = {index: self.target.outgoing(self.job, result) for index, result in self.kept.results.items()}
        values = kept | {r.task.index: r.value for r in ran}
        return [values[task.index] for task in self.tasks]

    def fail(self, failure: BaseException, *, writing: bool, damaged: bool = False) -> None:
        """After ``failure``: killed, out of space or interrupted while tasks ran (``writing``),
        what finished stays, with its records, for resume (in a resumed run, whenever it fails:
        those files were there before it); a fresh run failing to plan or commit leaves nothing,
        as a save does. A ``damaged`` source (a checksum mismatch) leaves nothing, in a resumed
        run too: a task finished before the verdict, in this run or the dead one, may have read
        the damaged bytes, and a resume after the file is restored would keep them."""
        if damaged:
            self.staging.discard()
            if self.records:
                failure.add_note(
                    "nothing was kept for --resume (tasks that finished before the check may have read the "
                    "damaged bytes): once the source is restored, convert again"
                )
            return
        if not (self.records and (writing or self.resumed)):
            self.staging.discard()
            return
        kept_files = resume.finished_files(self.target, self.tasks, self.staging)
        self.staging.discard_keeping(kept_files)
        if kept_files:
            failure.add_note(resume.kept_note(self.target, self.tasks, self.staging, kept_files))


def stage_job(job: Job, target: Target, options: Options, governor: MemoryGovernor, plan: Planner) -> StagedJob:
    """Plan ``job`` with ``plan`` (or take the dead conversion's recorded plan, with ``resume``),
    take hold of the destination, and keep what a resume can keep; on failure the destination is
    as it was (a refused resume leaves the dead conversion's files as they were).

    Raises:
        ResumeError: ``resume`` of a job that cannot resume, or of a dead conversion of another job.
        Otherwise as ``plan`` and :meth:`~parallel_dcp.jobs.targets.Target.stage`.
    """
    if options.resume:
        resume.refuse_unsupported(job, target, options)
    records = resume.resumable(job, target, options)
    identity = resume.identity(job, target, options) if records else {}
    planned, staging = _plan_and_stage(job, target, options, governor, identity, plan)
    digest = resume.job_digest(identity)
    root = staging.location.root
    staged = StagedJob(
        job=planned.job,
        tasks=planned.tasks,
        workers=planned.workers,
        staging=staging,
        target=target,
        records=records,
        kept=resume.Kept(),
        recorder=resume.Recorder(root, staging.save_id, digest, target, planned.job)
        if records and isinstance(root, Path)
        else None,
    )
    try:
        staging.expect(target.output_names(staged.tasks))
        if staged.resumed:
            staged.kept = resume.keep_finished(staged.job, target, staged.tasks, staging, digest)
            _check_what_runs(staged)
        elif records:
            resume.start_record(staging, identity, resume.plan_record(staged.tasks, planned.threshold, target))
    except BaseException as failure:
        staged.fail(failure, writing=False)
        raise
    return staged


def _check_what_runs(staged: StagedJob) -> None:
    """A resume's recorded plan: the checksummed source files its remaining tasks read go to
    them to hash (the kept tasks' files were hashed by the dead run, but are read again now)."""
    if staged.job.checks is None:
        return
    checks, staged.tasks = plan_checks(staged.job.checks, staged.tasks, staged.job.chunks, skip=staged.kept.results)
    staged.job = dataclasses.replace(staged.job, checks=checks)


def _plan_and_stage(
    job: Job,
    target: Target,
    options: Options,
    governor: MemoryGovernor,
    identity: dict[str, Any],
    plan: Planner,
) -> tuple[Planned, Staging]:
    """Plan, then take hold of the destination; with ``resume``, take hold first, since the plan
    is then the dead conversion's, if there is one to continue."""
    protect = list(job.source.files)
    if not options.resume:
        with gc_paused():
            planned = plan(job, target, options, governor)
        return planned, target.stage(options.overwrite, protect=protect)
    staging = target.stage(options.overwrite, protect=protect, resume=resume.check_identity(identity))
    try:
        with gc_paused():
            if staging.resumed is None:
                return plan(job, target, options, governor), staging
            return resume.replan(job, target, options, governor, staging.resumed), staging
    except BaseException:
        if staging.resumed is None:
            staging.discard()
        else:  # refused after all: the dead conversion's files stay as they were
            staging.discard_keeping(resume.adopted_files(staging))
        raise
