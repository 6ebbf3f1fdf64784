"""Distributed merges on Dask: plan once here, execute the plan's output shards on workers, commit once here.

The coordinator (this process) plans the merge as `jobs.merge` does, cuts the output layout into tasks of
contiguous shards with balanced bytes (base + planned expert + output bytes), and submits each task — the
part of the plan that computes its shards (`pipeline.execute.restrict_plan`), never a catalog connection —
to the cluster. A worker executes its part (`pipeline.execute.execute_shards`) into a directory unique to the
attempt, inside the merge's staging directory, and returns its per-shard results: sha256 and size of each
shard, xxh3 and block statistics of each tensor, realized bytes per expert. The coordinator checks realized
== planned per expert (`combine_shard_results`), moves the winning attempt's shards to their final names,
and commits once (`jobs.run_plan`): output and manifest are byte-identical to the single-process merge of the
same spec, budget and shard size.

A worker that dies mid-task leaves only its attempt directory behind (removed with the staging directory);
Dask runs the task again on another worker, or, past `distributed.scheduler.allowed-failures`, the merge
fails with `WorkerLostError` and nothing is visible. Staging and checkpoints must be paths every worker sees
(a shared file system) or object storage.

An output in an object store (``--out s3://bucket/prefix``: staging is an `io.s3.AttemptPrefix`): each task
attempt writes through the byte store under keys of its own (`io.s3.task_attempt`:
``NAME.<task>.<attempt>.safetensors``, owned by the merge's attempt); the coordinator copies the returned
attempts' shards server-side to the keys the index names (``NAME.<attempt>.safetensors``) and deletes every
task key (a dead worker's too; an upload it left unfinished is aborted by `gc`). Index, manifest, catalog
commit and ``manifest.json`` last are then the single-process S3 merge's. The coordinator's storage options
(`io.s3.storage_options`: ``--storage-option``, ``storage_options=``) travel with each task and are applied
in the worker process before it reads or writes, so workers need no ``AWS_*`` environment of their own
(they are process-wide there: tasks of merges with different options must not share a worker at once).

`dask`/`distributed` are imported inside the functions, so `mergepipe --help` does not load them.
"""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mergepipe_db.core.plan import Plan
from mergepipe_db.core.results import ExecutionResult, OutTensor
from mergepipe_db.core.spec import MergeSpec
from mergepipe_db.db.engine import Database
from mergepipe_db.errors import DistributedError, MergePipeError, WorkerLostError
from mergepipe_db.io import open_store
from mergepipe_db.jobs import MergeResult, check_outputs, plan_merge, run_plan

#: the directory inside staging that holds one subdirectory per task attempt
ATTEMPTS_DIR = ".attempts"
#: tasks per worker a merge is cut into at most (more tasks: finer balance and retries; fewer: less overhead)
TASKS_PER_WORKER = 4
#: seconds to wait for a scheduler given by address, and for a first worker
CONNECT_TIMEOUT_S = 10


def shard_costs(plan: Plan, out_tensors: list[OutTensor], n_shards: int) -> list[int]:
    """Bytes each output shard moves: its base tensors read, its planned expert bytes, its output written."""
    planned: dict[int, int] = {}
    for (_pos, tidx), reads in plan.access.items():
        planned[tidx] = planned.get(tidx, 0) + sum(r.nbytes for r in reads)
    base = {t.idx: t.nbytes for t in plan.base_tensors}
    costs = [0] * n_shards
    for ot in out_tensors:
        costs[ot.shard] += base[ot.idx] + planned.get(ot.idx, 0) + ot.nbytes
    return costs


def split_tasks(costs: list[int], n_tasks: int) -> list[list[int]]:
    """Contiguous groups of shard indices, at most `n_tasks` of them, of balanced cost: shard i goes to group
    ⌊k · (bytes before i's midpoint) / total⌋, so each group holds about total/k (a shard larger than that
    stands alone, and the groups are then fewer). Every shard is in exactly one group, in order."""
    n = len(costs)
    k = max(1, min(n_tasks, n))
    total = sum(costs)
    if total == 0:
        return [list(range(n))]
    groups: dict[int, list[int]] = {}
    before = 0
    for i, c in enumerate(costs):
        g = min(k - 1, (2 * before + c) * k // (2 * total))
        groups.setdefault(g, []).append(i)
        before += c
    return [groups[g] for g in sorted(groups)]


def run_shard_task(plan: Plan, layout: tuple[list[OutTensor], list[str]], shards: list[int], staging: str,
                   verify_reads: bool, storage_options: dict[str, str] | None = None
                   ) -> tuple[list[int], str, ExecutionResult]:
    """On a worker: execute `shards` of `plan` into a new attempt of its own in `staging`. Returns (shards,
    attempt, result). `storage_options` (the coordinator's, `io.s3.storage_options`) are applied in this
    process first, so a worker needs no ``AWS_*`` environment of its own.

    A local `staging` directory: the attempt is a directory in its `ATTEMPTS_DIR`, which must exist (the
    coordinator made it: once the merge is abandoned, a late attempt fails instead of re-creating staging).
    An object-store `staging` (the record of an `io.s3.AttemptPrefix`): the attempt is a key space of its own
    under the output prefix (`io.s3.task_attempt`), returned as its record."""
    import sys

    from mergepipe_db.core import faults
    from mergepipe_db.pipeline.execute import execute_shards

    if storage_options or "mergepipe_db.io.s3" in sys.modules:  # the coordinator's settings, not a stale task's
        from mergepipe_db.io.s3 import set_storage_options

        set_storage_options(storage_options)
    tag = f"{shards[0]:05d}-{uuid.uuid4().hex[:12]}"
    remote = _remote_staging(staging)
    if remote is not None:
        from mergepipe_db.io.s3 import task_attempt

        attempt: Any = task_attempt(remote, f"t{tag}")
    else:
        attempt = Path(staging) / ATTEMPTS_DIR / tag
        attempt.mkdir()
    faults.point("task_started")
    return shards, str(attempt), execute_shards(plan, attempt, layout, shards, verify_reads=verify_reads)


def _remote_staging(staging: Any) -> Any:
    """The `io.s3.AttemptPrefix` a staging record names; None for a local staging directory."""
    if not str(staging).lower().startswith("s3://"):
        return None
    from mergepipe_db.io.s3 import AttemptPrefix

    return AttemptPrefix.parse(str(staging))


class DaskExecutor:
    """`jobs.run_plan`'s executor for a Dask cluster: the same arguments and result as `pipeline.execute.
    execute`, the shards computed on the cluster's workers."""

    def __init__(self, client: Any, *, tasks_per_worker: int = TASKS_PER_WORKER) -> None:
        self.client = client
        self.tasks_per_worker = tasks_per_worker
        self.n_tasks = 0

    def __call__(self, plan: Plan, staging: Path, *, shard_bytes: int, progress: bool, verify_reads: bool
                 ) -> ExecutionResult:
        from distributed import as_completed
        from tqdm import tqdm

        from mergepipe_db.pipeline.execute import combine_shard_results, output_layout, restrict_plan

        t0 = time.perf_counter()
        layout = output_layout(plan, shard_bytes)
        out_tensors, names = layout
        n_workers = max(1, len(self.client.scheduler_info().get("workers", {})))
        groups = split_tasks(shard_costs(plan, out_tensors, len(names)), self.tasks_per_worker * n_workers)
        self.n_tasks = len(groups)
        remote = _remote_staging(staging)
        if remote is None:
            (staging / ATTEMPTS_DIR).mkdir()
        else:  # each shard will be one server-side copy
            from mergepipe_db.io.s3 import check_copyable

            sizes = [0] * len(names)
            for ot in out_tensors:
                sizes[ot.shard] += ot.nbytes
            check_copyable(sizes)
        options = _storage_options()
        run_id = uuid.uuid4().hex[:12]
        futures = []
        for i, shards in enumerate(groups):
            wanted = set(shards)
            part = restrict_plan(plan, {ot.idx for ot in out_tensors if ot.shard in wanted})
            futures.append(self.client.submit(run_shard_task, part, layout, shards, str(staging), verify_reads,
                                              options, key=f"mergepipe-shards-{run_id}-{i:05d}", pure=False))
        t_dispatch = time.perf_counter() - t0
        parts: list[tuple[list[int], ExecutionResult]] = []
        attempts: dict[int, str] = {}
        bar = tqdm(total=len(names), unit="shard", desc="merge", disable=not progress, leave=False, mininterval=0)
        t0 = time.perf_counter()
        try:
            for fut in as_completed(futures):
                shards, attempt, res = _task_result(fut)
                parts.append((shards, res))
                attempts[shards[0]] = attempt
                bar.update(len(shards))
        except MergePipeError as e:  # WorkerLostError and DistributedError are MergePipeErrors
            # the other tasks may still be writing: let them end, so that what they write is removed with the
            # attempt (a cancelled task runs on in its worker). Not when the scheduler itself is gone.
            scheduler_lost = isinstance(e, DistributedError) and not isinstance(e, WorkerLostError)
            if not scheduler_lost:
                _settle(futures)
            self.client.cancel(futures)
            raise
        except BaseException:
            self.client.cancel(futures)
            raise
        finally:
            bar.close()
        t_tasks = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = combine_shard_results(plan, layout, parts)
        if remote is not None:  # the attempts that returned: their shards copied to the keys the index names
            from mergepipe_db.io.s3 import AttemptPrefix, publish_task_shards, remove_task_attempts

            for shards, _res in parts:
                task = AttemptPrefix.parse(attempts[shards[0]])
                assert task is not None
                publish_task_shards(remote, task, [names[s] for s in shards])
            remove_task_attempts(remote, keep={remote.object_name(n) for n in names})  # and what killed ones left
        else:
            store = open_store(staging)
            for shards, _res in parts:  # the attempts that returned: their shards under their final names
                src = Path(attempts[shards[0]])
                for s in shards:
                    store.publish(src / names[s], staging / names[s])
            shutil.rmtree(staging / ATTEMPTS_DIR)  # and what killed attempts left
        result.timings.update({"dispatch": t_dispatch, "tasks": t_tasks, "gather": time.perf_counter() - t0,
                               "n_tasks": float(len(groups)), "n_workers": float(n_workers)})
        return result


#: how long a failed merge waits for its other tasks to end before giving up on them (`_settle`)
SETTLE_TIMEOUT_S = 300.0


def _settle(futures: list[Any]) -> None:
    """Wait (bounded) until every task of a failed merge has finished, failed or lost its worker."""
    from distributed import wait

    with contextlib.suppress(Exception):
        wait(futures, timeout=SETTLE_TIMEOUT_S)


def _storage_options() -> dict[str, str]:
    """The coordinator's storage options (`--storage-option`, ``storage_options=``), handed to every task."""
    import sys

    if "mergepipe_db.io.s3" not in sys.modules:
        return {}
    from mergepipe_db.io.s3 import storage_options

    return storage_options()


def _task_result(fut: Any) -> tuple[list[int], str, ExecutionResult]:
    """A finished task's result; a worker lost past the scheduler's retries is `WorkerLostError`, a lost
    scheduler or a task cancelled from outside `DistributedError`; errors the task raised (typed ones
    included) are re-raised as they are."""
    from concurrent.futures import CancelledError

    from distributed import KilledWorker
    from distributed.comm.core import CommClosedError

    try:
        return fut.result()
    except MergePipeError:
        raise
    except KilledWorker as e:
        raise WorkerLostError(f"a Dask worker died executing part of the merge ({e}); the scheduler gave up "
                              f"retrying it: nothing was published") from e
    except (CommClosedError, TimeoutError, CancelledError) as e:  # the scheduler or the client went away
        raise DistributedError(f"lost the Dask cluster during the merge ({type(e).__name__}: {e}): nothing was "
                               f"published") from e


@contextlib.contextmanager
def open_client(client: Any = None, *, workers: int | None = None, scheduler: str | None = None
                ) -> Iterator[Any]:
    """The `distributed.Client` to run on: `client` as given (left open), a client of the scheduler at
    `scheduler` (tcp://host:port), or of a local cluster of `workers` worker processes (one thread each)
    started for the merge; those two are closed afterwards. Exactly one of the three."""
    given = [x is not None for x in (client, workers, scheduler)]
    if sum(given) != 1:
        raise DistributedError("give exactly one of a Dask client, a number of workers or a scheduler address")
    if client is not None:
        yield client
        return
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise DistributedError(f"the number of Dask workers must be a positive integer, got {workers!r}")
    if scheduler is not None and not (isinstance(scheduler, str) and "://" in scheduler):
        raise DistributedError(f"a Dask scheduler address looks like tcp://host:8786, got {scheduler!r}")
    from distributed import Client, LocalCluster

    with contextlib.ExitStack() as stack:
        if scheduler is not None:
            try:
                c = Client(scheduler, timeout=CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError, ValueError) as e:
                raise DistributedError(f"cannot reach the Dask scheduler at {scheduler}: "
                                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        else:
            cluster = stack.enter_context(LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                                       dashboard_address=":0"))
            c = Client(cluster)
        stack.enter_context(c)
        yield c


def merge(db: Database, spec: str | Path | dict[str, Any] | MergeSpec, *, out: str | Path, budget: Any,
          seed: int | None, ref: str | None, shard_bytes: int | None, progress: bool, verify_reads: bool,
          client: Any = None, workers: int | None = None, scheduler: str | None = None) -> MergeResult:
    """`jobs.merge` with the execution on Dask (`open_client`): planned once here, the shards computed on the
    workers, committed once here. The same output and manifest as `jobs.merge` of the same arguments."""
    t_start = time.perf_counter()
    out_path, ref_name = check_outputs(out, ref, shard_bytes)
    with open_client(client, workers=workers, scheduler=scheduler) as c:
        try:
            c.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
        except TimeoutError as e:
            raise DistributedError(f"the Dask scheduler has no workers (waited {CONNECT_TIMEOUT_S} s): nothing "
                                   f"was written") from e
        t0 = time.perf_counter()
        plan, expected = plan_merge(db, spec, budget=budget, seed=seed, progress=progress, ref=ref_name)
        t_plan = time.perf_counter() - t0
        return run_plan(db, plan, out_path, ref_name, t_start=t_start, t_plan=t_plan, shard_bytes=shard_bytes,
                        progress=progress, verify_reads=verify_reads, expected=expected,
                        executor=DaskExecutor(c))
