"""A small synthetic corpus for CPU tests of the sweep and of every later stage (replay, train, certify).

`build_corpus(root)` writes root/fake-gpu-9000/ with a record for every valid candidate of every cell of a
few small geometries, under a fake provenance carrying the real kernel digest (so digest checks pass).
The timings follow a crude but plausible model, so a policy has something to learn: time = bytes read at
3 TB/s, slowed when the grid cannot fill the GPU, plus a launch cost per kernel (more in eager mode), with
a few percent of deterministic per-candidate noise.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner
from gemv_dispatch.dispatch import __version__
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.common.gpu import gpu_slug
from gemv_dispatch.dispatch.measure import corpus
from gemv_dispatch.dispatch.measure.corpus import SHARDS, Cell, Provenance, Record, timing_parameters
from gemv_dispatch.dispatch.measure.shapes import Inventory, Shape, write_inventory
from gemv_dispatch.dispatch.measure.timing import Stats, TimingConfig, cell_seed
from gemv_dispatch.kernels import program
from gemv_dispatch.kernels.codebooks import get
from gemv_dispatch.kernels.registry import Candidate, candidates_for

FAKE_GPU = "Fake GPU 9000"
FAKE_UUID = "GPU-00000000-0000-0000-0000-000000000001"
FAKE_SMS = 132
GEOMETRIES: tuple[tuple[int, int], ...] = ((256, 512), (1024, 4096))  # (N, K)
CODEBOOKS = ("Q4_0", "Q8_0")
MS = (1, 4)
MODES = ("graph", "eager")


def fake_provenance(gpu_name: str = FAKE_GPU, gpu_uuid: str = FAKE_UUID, kernel_digest: str | None = None,
                    timing: TimingConfig | None = None) -> Provenance:
    return Provenance(
        gpu_name=gpu_name, gpu_uuid=gpu_uuid, sm_count=FAKE_SMS, l2_bytes=50 << 20, sm_clock_mhz=1980,
        mem_clock_mhz=3201, driver_version="999.0", cuda_runtime="13.0", cupy_version=None,
        kernel_digest=kernel_digest or program.digest(), tool_version=__version__,
        timing=timing_parameters(timing or TimingConfig()),
    )


def cells(geometries: Iterable[tuple[int, int]] = GEOMETRIES, codebooks: Iterable[str] = CODEBOOKS,
          ms: Iterable[int] = MS, modes: Iterable[str] = MODES) -> list[Cell]:
    return sorted(Cell(cb, m, n, k, mode) for cb in codebooks for n, k in geometries for m in ms for mode in modes)


def fake_stats(cell: Cell, candidate: Candidate) -> Stats:
    weight_bytes = cell.n * cell.k * get(cell.codebook).bits_per_weight / 8
    (gx, gy, _), _ = candidate.launch_geometry(cell.m, cell.n, cell.k)
    fill = min(1.0, gx * gy / (4 * FAKE_SMS))
    launch_us = (3.0 if cell.mode == "eager" else 1.5) * (1.2 if candidate.grid_split else 1.0)  # kpar's fold
    noise = np.random.default_rng(cell_seed(cell.codebook, cell.m, cell.n, cell.k, cell.mode, candidate.id))
    median = (weight_bytes / (3.0e6 * fill) + launch_us) * (1.0 + 0.05 * float(noise.random()))
    mad = 0.01 * median
    return Stats(median, median - 2 * mad, median + 3 * mad, mad, 25, 100, False)


def fake_records(cell: Cell, provenance: Provenance) -> list[Record]:
    return [Record.measured(cell, c, fake_stats(cell, c), 8, provenance.key)
            for c in candidates_for(cell.m, cell.n, cell.k)]


def build_corpus(root: Path, provenance: Provenance | None = None, *, compact: bool = True,
                 **plan: Iterable) -> Path:
    """Write one shard per cell (as a sweep does) into root/<gpu-slug>/, compact unless told not to, return
    the folder. `plan` may override geometries, codebooks, ms, modes (see `cells`)."""
    provenance = provenance or fake_provenance()
    folder = Path(root) / gpu_slug(provenance.gpu_name)
    corpus.init(folder)
    for cell in cells(**plan):
        corpus.write_shard(folder, provenance, fake_records(cell, provenance))
    if compact:
        corpus.compact(folder)
    return folder


def shard_paths(folder: Path) -> list[Path]:
    return sorted((folder / SHARDS).glob("*.jsonl.gz"))


def shard_text(path: Path) -> bytes:
    """A shard file's text (shards are gzip files named after the SHA-256 of their text)."""
    return gzip.decompress(path.read_bytes())


def put_text(path: Path, data: bytes) -> None:
    """Write a shard file holding the text `data`, compressed as a writer compresses it."""
    path.write_bytes(gzip.compress(data, mtime=0))


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under folder, by relative path: what two corpora must agree on byte for byte."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_shapes(path: Path, geometries: Iterable[tuple[int, int]] = GEOMETRIES) -> Path:
    """An inventory file holding `geometries`, for `sweep --shapes`."""
    shapes = tuple(Shape(n, k, f"g{i}", "fixture", "fixture") for i, (n, k) in enumerate(geometries))
    return write_inventory(Inventory("fixture", "fixture", "tests/corpus_fixture.py", shapes), path)


# The replay sweep through the CLI (tests of the sweep and of the fleet): the plan every replay times.
SLUG = gpu_slug(FAKE_GPU)
PLAN_ARGS = ["--codebooks", "Q4_0,Q8_0", "--m", "1,4", "--modes", "graph,eager"]


def sweep_args(source: Path, shapes: Path, root: Path, *extra: str) -> list[str]:
    return ["sweep", "--replay", str(source), "--shapes", str(shapes), "--corpus-root", str(root),
            *PLAN_ARGS, *extra]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))
