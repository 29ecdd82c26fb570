"""Fleet sweep (docs/architecture.md §4): `sweep --ray`, the plan timed on every GPU of a Ray cluster.

One Ray actor per GPU (num_gpus=1, pinned to its node) builds its timer on first use, holds its GPU's lock
(gpulock) for its lifetime and measures whole geometry groups: every cell of one (codebook, N, K), so the
weights are made once per group. Each GPU model gets its own folder corpus_root/<gpu-slug>/ and the whole
plan once, its groups dealt among that model's actors as they come free.

The driver is the only writer: it stages one shard per returned (cell, provenance) and compacts each folder
at the end, as run_sweep does. Faults are Ray's: a dead worker process is restarted in place and its call
retried (max_restarts, max_task_retries); an actor out of restarts (its node gone) has its group dealt to the
model's other actors. A (cell, provenance) the folder holds or this run staged is never staged again, so a
retried group duplicates nothing. Ray is imported lazily: the package works without the `fleet` extra.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ...kernels.errors import EnvironmentProblem, InputError
from ...kernels.registry import candidates_for
from ..common.gpu import gpu_slug
from . import corpus, gpulock
from .corpus import Cell, Corpus, Provenance
from .sweep import (
    CellTiming,
    GpuTimer,
    Progress,
    ReplayTimer,
    SweepPlan,
    SweepResult,
    Timer,
    cell_provenances,
    cell_work,
    stage_cell,
)
from .timing import TimingConfig

RESTARTS = 3  # a worker process that dies is restarted in place, and its call retried, this often


@dataclass(frozen=True)
class GpuSpec:
    """Each actor times its own GPU: Ray shows it only that one (CUDA_VISIBLE_DEVICES)."""

    timing: TimingConfig

    def timer(self, index: int) -> Timer:
        return GpuTimer(self.timing)


@dataclass(frozen=True)
class ReplaySpec:
    """Actor `index` replays folders[index % len(folders)]: a fleet of one fake GPU model per corpus, for CPU
    clusters and tests. The folders must be readable where the actors run."""

    folders: tuple[str, ...]
    delay_s: float = 0.0

    def timer(self, index: int) -> Timer:
        return ReplayTimer(corpus.load(self.folders[index % len(self.folders)]), self.delay_s)


TimerSpec = GpuSpec | ReplaySpec  # how an actor builds its timer, sent to it by the driver


@dataclass(frozen=True)
class Identity:
    gpu_name: str
    kernel_digest: str
    where: str  # host and pid: the fleet's log names where each GPU is timed
    served: dict[Cell, tuple[Provenance, ...]]  # the plan's cells and the provenances this actor records them under


Measured = tuple[Cell, Provenance, CellTiming]


class Worker:
    """A Ray actor's body (run_fleet wraps it with ray.remote): one GPU. The timer is built on first use,
    again after a restart; the GPU's lock goes with the process."""

    def __init__(self, spec: TimerSpec, index: int, wait: bool) -> None:
        self._spec, self._index, self._wait = spec, index, wait
        self._lock = contextlib.ExitStack()  # never closed: released when the process ends
        self._built: Timer | None = None

    def _timer(self) -> Timer:
        if self._built is None:
            timer = self._spec.timer(self._index)
            if timer.lock_key:
                self._lock.enter_context(gpulock.hold(timer.lock_key, wait=self._wait))
            self._built = timer
        return self._built

    def describe(self, cells: list[Cell]) -> Identity:
        timer = self._timer()
        return Identity(timer.gpu_name, timer.kernel_digest, f"{socket.gethostname()} pid {os.getpid()}",
                        cell_provenances(cells, timer))

    def measure(self, todo: list[tuple[Cell, frozenset[str]]]) -> list[Measured]:
        """Each cell under each of its provenances here, but those already done (the keys beside it)."""
        timer, out = self._timer(), []
        for cell, done in todo:
            candidates = candidates_for(cell.m, cell.n, cell.k)
            out += [(cell, p, timer.measure(cell, p, candidates)) for p in timer.provenances(cell) if p.key not in done]
        return out


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise EnvironmentProblem("Ray is not installed: pip install 'gemv-dispatch[fleet]'") from None
    return ray


@contextlib.contextmanager
def connected(address: str | None) -> Iterator[ModuleType]:
    """Ray, connected to `address` as ray.init spells it ("auto", "ray://host:10001"); without one, to the
    Ray this process already runs, else as ray.init finds one (RAY_ADDRESS, a local `ray start`) or starts it."""
    ray = _ray()
    # Ray forwards the workers' output and its own error reports (a worker died, a retry) to stdout, which
    # carries only the summary here.
    with contextlib.redirect_stdout(sys.stderr):
        if address is None and ray.is_initialized():
            yield ray
            return
        ray.init(address=address, logging_level=logging.WARNING)
        try:
            yield ray
        finally:
            ray.shutdown()


def _get(ray: ModuleType, refs: Any) -> Any:
    """ray.get, re-raising an actor's one-line errors (bad input, a busy GPU, a missing file) as themselves."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, InputError | EnvironmentProblem | OSError):
            raise err.cause from None
        raise


def _start(ray: ModuleType, spec: TimerSpec, wait: bool) -> list[Any]:
    """One actor per GPU of every live node, pinned to it: a restart stays on that GPU model and host."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_gpus=1, num_cpus=1, max_restarts=RESTARTS, max_task_retries=RESTARTS)(Worker)
    nodes = [(n["NodeID"], int(n["Resources"].get("GPU", 0))) for n in ray.nodes() if n["Alive"]]
    slots = [node for node, gpus in nodes for _ in range(gpus)]
    if not slots:
        raise EnvironmentProblem("the Ray cluster has no GPU")
    return [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(spec, i, wait)
            for i, node in enumerate(slots)]


@dataclass
class _Model:
    """One GPU model's folder, actors and groups left to deal."""

    name: str
    folder: Path
    actors: dict[Any, Identity]
    done: dict[str, set[Cell]]  # provenance key -> cells complete in the folder or staged by this run
    queue: collections.deque[list[Cell]]
    compact: bool  # staged or unlisted shards to merge at the end
    existing: Corpus  # what the folder held at the start: a cell timed again stores only what it lacked
    idle: list[Any] = field(default_factory=list)

    def todo(self, group: list[Cell]) -> list[tuple[Cell, frozenset[str]]]:
        return [(cell, frozenset(key for key, cells in self.done.items() if cell in cells)) for cell in group]


def _models(root: Path, cells: list[Cell], groups: list[list[Cell]], actors: dict[Any, Identity]) -> list[_Model]:
    """Each GPU model's folder (recovered as run_sweep does) and the groups with cells it lacks: a cell is done
    when it is complete under every provenance one of the model's actors records it under."""
    models = []
    for name, members in itertools.groupby(sorted(actors.items(), key=lambda a: a[1].gpu_name),
                                           key=lambda a: a[1].gpu_name):
        own = dict(members)
        digests = {i.kernel_digest for i in own.values()}
        if len(digests) > 1:
            raise EnvironmentProblem(f"the {name} GPUs of the fleet run different kernel sources: "
                                     f"{', '.join(sorted(d[:12] for d in digests))}")
        folder = root / gpu_slug(name)
        existing, actions = corpus.resume(folder, gpu_name=name)
        for action in actions:
            print(f"{folder}: {action}", file=sys.stderr)
        keys = {p.key for i in own.values() for c in cells for p in i.served[c]}
        done = {key: existing.done_cells(key) for key in keys}
        lacking = {c for c in cells if not any(all(c in done[p.key] for p in i.served[c]) for i in own.values())}
        queue = collections.deque(todo for g in groups if (todo := [c for c in g if c in lacking]))
        models.append(_Model(name, folder, own, done, queue, len(existing.shards) != len(existing.provenances),
                             existing))
    return models


def run_fleet(plan: SweepPlan, corpus_root: str | os.PathLike[str], spec: TimerSpec, *,
              address: str | None = None, wait: bool = False) -> SweepResult:
    """Time the plan once per GPU model of the Ray cluster at `address` (see `connected`) into
    corpus_root/<gpu-slug>/, skipping what each folder holds; the result counts the plan's cells once per
    model. Every GPU of the cluster gets an actor, so one held by another Ray job delays the start until it is
    free; `wait` lets each actor wait for another sweep of its GPU instead of refusing."""
    start = time.monotonic()
    cells = plan.cells()
    groups = [list(g) for _, g in itertools.groupby(cells, key=lambda c: (c.codebook, c.n, c.k))]
    groups.sort(key=lambda g: -sum(map(cell_work, g)))  # largest first: the run ends on short groups
    with connected(address) as ray:
        handles = _start(ray, spec, wait)
        try:
            refs = [h.describe.remote(cells) for h in handles]
            # Every actor answers before one's error is raised: an actor killed mid-call has Ray print a retry
            # notice beside the error's one line.
            ray.wait(refs, num_returns=len(refs))
            identities = _get(ray, refs)
            for i, ident in enumerate(identities):
                print(f"GPU {i}: {ident.gpu_name} on {ident.where}", file=sys.stderr)
            models = _models(Path(corpus_root), cells, groups, dict(zip(handles, identities, strict=True)))
            todo = sum(len(g) for m in models for g in m.queue)
            timed, records = _deal(ray, models)
        finally:
            for h in handles:
                ray.kill(h)
    keys = {p.key for i in identities for ps in i.served.values() for p in ps}
    total = len(cells) * len(models)
    return SweepResult(tuple(sorted(str(m.folder) for m in models)), tuple(sorted(keys)), total, timed, total - todo,
                       records, time.monotonic() - start)


def _deal(ray: ModuleType, models: list[_Model]) -> tuple[int, int]:
    """Hand out each model's groups to its free actors and stage what comes back, each (cell, provenance)
    once; returns the (cell, provenance) pairs timed and the records staged."""
    # The ETA's order: the models' groups interleaved, as their actors work side by side.
    order = [g for gs in itertools.zip_longest(*(m.queue for m in models)) for g in gs if g]
    progress = Progress([cell_work(c) for g in order for c in g])
    outstanding: dict[Any, tuple[_Model, Any, list[Cell]]] = {}

    def deal(model: _Model, actor: Any) -> None:
        if not model.queue:
            model.idle.append(actor)
            return
        group = model.queue.popleft()
        outstanding[actor.measure.remote(model.todo(group))] = (model, actor, group)

    for model in models:
        for actor in model.actors:
            deal(model, actor)
    finished = timed = records = 0
    while outstanding:
        [ref], _ = ray.wait(list(outstanding))
        model, actor, group = outstanding.pop(ref)
        try:
            measured: list[Measured] = _get(ray, ref)
        except ray.exceptions.RayActorError:  # out of restarts: the model's other actors take its group
            del model.actors[actor]
            if not model.actors:
                raise EnvironmentProblem(f"every {model.name} GPU of the fleet is lost (crashed {RESTARTS + 1} "
                                         "times, or its node is gone); rerun to resume") from None
            model.queue.appendleft(group)
            while model.idle and model.queue:
                deal(model, model.idle.pop())
            continue
        for cell, provenance, timing in measured:
            if provenance.gpu_name != model.name:  # pinned to its node, an actor keeps its model
                raise EnvironmentProblem(f"an actor of the {model.name} GPUs came back on a {provenance.gpu_name}")
            if cell in model.done.setdefault(provenance.key, set()):
                continue  # whatever was retried or dealt again, a (cell, provenance) is staged once
            # The cell was timed whole; what the folder already holds current under this provenance stays.
            missing = set(model.existing.missing(cell, provenance, model=False))
            records += stage_cell(model.folder, cell, provenance, timing,
                                  [c for c in candidates_for(cell.m, cell.n, cell.k) if c.id in missing])
            model.done[provenance.key].add(cell)
            timed, model.compact = timed + 1, True
        finished += len(group)
        progress.update(finished, f"{model.folder.name}: {group[-1]}")
        deal(model, actor)
    for model in models:
        if model.compact:
            corpus.compact(model.folder)
    return timed, records
