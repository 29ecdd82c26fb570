"""Runtime benchmark, on a GPU, with no dispatch table installed (GEMV_DISPATCH_TABLES is pointed at an empty
folder for the run, so the runtime serves what a fresh install serves: a shipped table, or the safe default).

1. Host cost per call, Q4_0, N = K = 4096, M = 1 and 16, on an explicit non-blocking stream: a raw prepared
   cuLaunchKernel of the kernel the runtime launches (kernels.launch.PreparedLaunch with every argument fixed,
   called through cupy.cuda.driver.launchKernel: the least a Python caller can pay), `gemv(w, qx)` (targets: at
   most 1.5 us over the raw launch), `quantize(x)` (at most 6 us), `gemv(w, x)`, `gemv(w, qx)` from a default
   stream (bridged by events), and with torch tensors on torch's current stream `quantize`, `gemv(w, qx)` and
   `gemv(w, x)` (at most 10 us in all). Host time: time.perf_counter_ns around batches of CALLS calls after a
   warm-up batch, the median over BATCHES batches of ns per call, the device drained between batches so launch
   queues never fill.
2. The served launch's device time against the cell's fastest launch, Q4_0 on the anchor shapes at M in
   NO_TABLE_MS (target: at most 1.3x): every candidate valid for the cell, as CUDA-graph replays on one explicit
   stream with events recorded on it, cold L2, interleaved rounds after warm-up, no racing, medians
   (dispatch.measure.timing).
A short table is printed last; everything goes to --out as JSON.

    python bench/runtime_overhead.py --out bench/results/runtime-nvidia-h200.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import cupy as cp
from anchors import ANCHORS
from gemv_dispatch.dispatch.measure.sweep import sweep_timing
from gemv_dispatch.dispatch.measure.timing import CupyBackend, copies_for_cold_l2, time_candidates
from gemv_dispatch.dispatch.serve import runtime
from gemv_dispatch.kernels import launch
from gemv_dispatch.kernels.registry import candidates_for

CODEBOOK = "Q4_0"
HOST_MS = (1, 16)
NO_TABLE_MS = (1, 2, 4, 8, 16)
CALLS, BATCHES = 200, 25  # per batch: well under the launch queue depth, also at two launches per call
TARGETS_US = {"gemv_qx_over_raw": 1.5, "quantize": 6.0, "torch_gemv_x": 10.0, "no_table_ratio": 1.3}
CONFIG = replace(sweep_timing(), mode="graph", race=False, window_us=300.0)


def device_weights(n: int, k: int, seed: int) -> runtime.Weights:
    """Random device planes wrapped as prepared weights (prepare() would quantize on the CPU: too slow here)."""
    planes = launch.random_weights(CODEBOOK, n, k, cp.random.default_rng(seed))
    cp.cuda.Device().synchronize()
    return runtime.Weights(CODEBOOK, CODEBOOK.lower(), n, k, cp.cuda.runtime.getDevice(), planes)


def host_us(call: Callable[[], Any], drain: Callable[[], None]) -> float:
    """Median host microseconds per call: BATCHES batches of CALLS calls after one warm-up batch."""
    samples = []
    for batch in range(BATCHES + 1):
        drain()
        t0 = time.perf_counter_ns()
        for _ in range(CALLS):
            call()
        if batch:
            samples.append((time.perf_counter_ns() - t0) / CALLS / 1e3)
    drain()
    return statistics.median(samples)


def raw_launch(w: runtime.Weights, qx: runtime.Activations, out: Any, stream: Any) -> tuple[Callable[[], None], str]:
    """The launch the runtime resolved for (w, M, eager), prepared with every argument fixed, as a bare
    cuLaunchKernel call; and its candidate."""
    cand = runtime.choice_for(w, qx.m).candidate
    need = cand.workspace_bytes(qx.m, w.n, w.k)
    ws = launch.new_workspace(need, w.n) if need else None
    qa, da, sa = qx.ptrs
    prepared = launch.plan(cand, w.planes, qx.m).prepare(
        {"qa": qa, "da": da, "sa": sa, "out": out.data.ptr, "ws": launch.address(ws)}, keep=(qx, out, ws))
    f, gx, gy, gz, bx, by, bz, shared = prepared.head
    argv, handle, launch_kernel = prepared.argv, stream.ptr, cp.cuda.driver.launchKernel

    def raw(held: launch.PreparedLaunch = prepared) -> None:  # held: the launch whose buffer `argv` addresses
        launch_kernel(f, gx, gy, gz, bx, by, bz, shared, handle, argv, 0)
    return raw, cand.id


def host_costs(stream: Any, n: int, k: int, m: int) -> dict[str, Any]:
    """Host us per call of the raw launch and of the runtime's entry points (section 1)."""
    w = device_weights(n, k, 1)
    with stream:
        x = cp.random.default_rng(2).standard_normal((m, k), dtype=cp.float32)
        out = cp.empty((m, n), cp.float32)
        qx = runtime.quantize(x)
        runtime.gemv(w, qx, out=out)  # resolve and prepare the launch before timing
        raw, cid = raw_launch(w, qx, out, stream)
        row: dict[str, Any] = {
            "candidate": cid,
            "raw_launch_us": host_us(raw, stream.synchronize),
            "gemv_qx_us": host_us(lambda: runtime.gemv(w, qx, out=out), stream.synchronize),
            "quantize_us": host_us(lambda: runtime.quantize(x), stream.synchronize),
            "gemv_x_us": host_us(lambda: runtime.gemv(w, x, out=out), stream.synchronize),
        }
    row["gemv_qx_over_raw_us"] = row["gemv_qx_us"] - row["raw_launch_us"]
    # A caller on the default stream (no `with stream`): two event records and two waits more per call.
    row["gemv_qx_default_stream_us"] = host_us(lambda: runtime.gemv(w, qx, out=out), cp.cuda.Device().synchronize)
    try:
        import torch
    except ImportError:
        row["torch"] = "torch is not installed"
        return row
    xt, outt = torch.randn(m, k, device="cuda"), torch.empty(m, n, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        qt = runtime.quantize(xt)
        runtime.gemv(w, xt, out=outt)
        row["torch_quantize_us"] = host_us(lambda: runtime.quantize(xt), side.synchronize)
        row["torch_gemv_qx_us"] = host_us(lambda: runtime.gemv(w, qt, out=outt), side.synchronize)
        row["torch_gemv_x_us"] = host_us(lambda: runtime.gemv(w, xt, out=outt), side.synchronize)
    return row


def weight_copies(n: int, k: int, l2: int) -> list[runtime.Weights]:
    """Copies of a random matrix to rotate through, together past 3x the L2 (cold L2)."""
    first = device_weights(n, k, 10)
    return [first] + [device_weights(n, k, 10 + i) for i in range(1, copies_for_cold_l2(first.planes.nbytes, l2))]


def served_vs_fastest(stream: Any, copies: list[runtime.Weights], m: int) -> dict[str, Any]:
    """Device us of the launch served without an installed table against the fastest candidate of the cell, all
    candidates timed in the same interleaved rounds (section 2)."""
    first = copies[0]
    n, k = first.n, first.k
    served = runtime.choice_for(first, m, "graph")
    cands = candidates_for(m, n, k)
    need = max(c.workspace_bytes(m, n, k) for c in cands)
    with stream:
        x = cp.random.default_rng(4).standard_normal((m, k), dtype=cp.float32)
        qact = launch.quantize_activations(x, stream)
        out = cp.empty((m, n), cp.float32)
        ws = launch.new_workspace(need, n) if need else None
        launches = {c.id: launch.bind(c, [w.planes for w in copies], qact, out, stream, ws) for c in cands}
        stream.synchronize()
    stats = time_candidates(launches, len(copies), CONFIG, CupyBackend(stream))
    fastest = min(stats, key=lambda cid: stats[cid].median_us)
    row = {"codebook": CODEBOOK, "m": m, "n": n, "k": k, "served": served.candidate.id, "source": served.source,
           "identity": served.identity, "fastest": fastest, "served_us": stats[served.candidate.id].median_us,
           "fastest_us": stats[fastest].median_us, "candidates": len(cands)}
    row["ratio"] = row["served_us"] / row["fastest_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument("--quick", action="store_true", help="three anchors only in section 2 (smoke run)")
    args = ap.parse_args()
    os.environ["GEMV_DISPATCH_TABLES"] = tempfile.mkdtemp(prefix="gemv-dispatch-no-tables-")
    props = cp.cuda.runtime.getDeviceProperties(0)
    device = {"name": props["name"].decode(), "sm_count": int(props["multiProcessorCount"]),
              "l2_bytes": int(props["l2CacheSize"]), "cupy": cp.__version__, "python": sys.version.split()[0]}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        served_by = runtime._STATE.dispatcher.table(runtime._STATE.gpu(0))
    result: dict[str, Any] = {
        "device": device, "targets": TARGETS_US,
        "serving": {"table": None if served_by is None else served_by.table.gpu_name,
                    "warning": [str(w.message) for w in said]}}
    stream = cp.cuda.Stream(non_blocking=True)
    t0 = time.time()
    result["host"] = {f"M={m}": host_costs(stream, 4096, 4096, m) for m in HOST_MS}
    print(json.dumps(result["host"]), flush=True)
    rows = []
    for n, k in ANCHORS[:3] if args.quick else ANCHORS:
        copies = weight_copies(n, k, device["l2_bytes"])
        for m in NO_TABLE_MS:
            rows.append(served_vs_fastest(stream, copies, m))
            print(json.dumps(rows[-1]), flush=True)
        del copies
        cp.get_default_memory_pool().free_all_blocks()
    result["no_table"] = rows
    result["seconds"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"\n{device['name']} ({device['sm_count']} SMs), CuPy {device['cupy']}; no table installed, serving: "
          f"{result['serving']['table'] or 'the safe default ' + runtime.SAFE_DEFAULT}")
    print(f"host us per call, {CODEBOOK} 4096x4096 (targets: gemv(qx) <= raw + {TARGETS_US['gemv_qx_over_raw']}, "
          f"quantize <= {TARGETS_US['quantize']}, torch gemv(x) <= {TARGETS_US['torch_gemv_x']}):")
    print(f"  {'M':>3} {'raw':>6} {'gemv(qx)':>9} {'over':>6} {'quant':>6} {'gemv(x)':>8} {'stream0':>8} "
          f"{'t.quant':>8} {'t.gemv(qx)':>10} {'t.gemv(x)':>9}")
    for key, h in result["host"].items():
        t = [h.get(f"torch_{name}_us", float("nan")) for name in ("quantize", "gemv_qx", "gemv_x")]
        print(f"  {key[2:]:>3} {h['raw_launch_us']:6.2f} {h['gemv_qx_us']:9.2f} {h['gemv_qx_over_raw_us']:+6.2f} "
              f"{h['quantize_us']:6.2f} {h['gemv_x_us']:8.2f} {h['gemv_qx_default_stream_us']:8.2f} "
              f"{t[0]:8.2f} {t[1]:10.2f} {t[2]:9.2f}")
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"served without a table vs the cell's fastest, device us, graph replays, cold L2 (target <= "
          f"{TARGETS_US['no_table_ratio']}x; worst {worst['ratio']:.2f}x):")
    for r in rows:
        print(f"  M={r['m']:<2} {r['n']:>6}x{r['k']:<6} {r['served']:24} {r['served_us']:8.2f} "
              f"{r['fastest']:24} {r['fastest_us']:8.2f} {r['ratio']:5.2f}x")


if __name__ == "__main__":
    main()
