"""Validate dispatch.measure.timing against Nsight Compute: graph-mode per-launch time vs ncu's gpu__time_duration.

Three single-launch candidates of different sizes are timed twice: by the harness (graph mode, cold L2,
medians over interleaved rounds) and under ncu (`--clock-control none`, its default cache control flushes
caches before each kernel, i.e. cold), whose per-kernel durations are medianed. Agreement within 10% means
the harness measures kernel time, not launch gaps or host overhead. Nothing measured here enters a corpus.

    python bench/timing_vs_ncu.py run --out bench/results/timing-vs-ncu-nvidia-h200.json
(`run` times with the harness, then re-executes itself under ncu with `profile`.)
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import cupy as cp
from gemv_dispatch.dispatch.measure.sweep import GpuTimer, sweep_timing
from gemv_dispatch.kernels import launch
from gemv_dispatch.kernels.registry import by_id

# (codebook, M, N, K, candidate): about 10, 30 and 90 microseconds on an H200.
CASES = [("Q4_0", 1, 14336, 4096, "direct.s8.t32.c1"), ("Q4_0", 1, 27648, 5120, "direct.s4.t64.c1"),
         ("Q4_0", 1, 151936, 4096, "wide.s1.t128.c1")]
PROFILED_LAUNCHES = 15
CONFIG = replace(sweep_timing(), min_rounds=15)  # the sweep's settings, all 15 rounds


def launch_cells(cells: list[tuple[str, int, int, int, str]], repeats: int = 3) -> None:
    """Launch each (codebook, M, N, K, candidate) `repeats` times on random weights, one stream."""
    stream = cp.cuda.Stream(non_blocking=True)
    for codebook, m, n, k, cid in cells:
        cand = by_id(cid)
        rng = cp.random.default_rng(n + k)
        with stream:
            weights = launch.random_weights(codebook, n, k, rng)
            x = rng.standard_normal((m, k), dtype=cp.float32)
            out = cp.empty((m, n), cp.float32)
            need = cand.workspace_bytes(m, n, k)
            workspace = launch.new_workspace(need, n) if need else None
        qact = launch.quantize_activations(x, stream)
        run = launch.bind(cand, [weights], qact, out, stream, workspace)
        for _ in range(repeats):
            run(0)
        stream.synchronize()


def harness() -> dict[str, float]:
    """Per-launch median of each case, timed as the sweep times a cell (all rounds, one candidate)."""
    timer = GpuTimer(CONFIG)
    return {cid: timer.time_cell(cb, m, n, k, CONFIG.mode, [by_id(cid)]).stats[cid].median_us
            for cb, m, n, k, cid in CASES}


def profile() -> None:
    """Launched under ncu: PROFILED_LAUNCHES launches per case (ncu's cache control makes each one cold)."""
    launch_cells([tuple(case) for case in CASES], PROFILED_LAUNCHES)


def ncu_durations() -> dict[str, float]:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv", "-k", "regex:gemv_",
           sys.executable, __file__, "profile"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = [r for r in csv.DictReader(io.StringIO(done.stdout[done.stdout.index('"ID"'):]))
            if r["Metric Name"] == "gpu__time_duration.sum"]
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    times = [float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]] for r in rows]
    assert len(times) == PROFILED_LAUNCHES * len(CASES), f"ncu reported {len(times)} kernels"
    return {case[-1]: statistics.median(times[i * PROFILED_LAUNCHES:(i + 1) * PROFILED_LAUNCHES])
            for i, case in enumerate(CASES)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "profile"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.what == "profile":
        profile()
        return
    ours, ncu = harness(), ncu_durations()
    rows = [{"case": list(case), "harness_graph_us": ours[case[-1]], "ncu_gpu_time_us": ncu[case[-1]],
             "ratio": ours[case[-1]] / ncu[case[-1]]} for case in CASES]
    report = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "config": CONFIG.__dict__,
              "rows": rows, "within_10pct": all(abs(r["ratio"] - 1) <= 0.10 for r in rows)}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        print(f"{r['case'][-1]:20} N={r['case'][2]:>6} K={r['case'][3]:>5}  harness {r['harness_graph_us']:8.2f} us  "
              f"ncu {r['ncu_gpu_time_us']:8.2f} us  ratio {r['ratio']:.3f}")
    print("within 10%:", report["within_10pct"])


if __name__ == "__main__":
    main()
