"""Runtime benchmark (issue 10, item 4), on a GPU:

1. host overhead of runtime.gemv() per call over a raw kernels.launch.bind launch of the same candidate
   (goal <= 2 us), for CuPy arrays (and torch tensors when torch is installed): host seconds of a loop of
   calls, median over batches, the device drained between batches so launch queues never fill;
2. quantize alone, eager: device time per call and host time per call (before the fix: 90-130 us, a host
   synchronization in every call);
3. end to end, quantize + gemv through the runtime vs the raw gemv launch alone, for the anchor shapes of
   bench/kernels.py (Q4_0, M = 1 and 16), as CUDA-graph replays and eager launches, cold L2
   (dispatch.measure.timing: events on one explicit stream, interleaved rounds, medians).
One table is printed last; everything goes to --out as JSON.

    python bench/runtime_overhead.py --out bench/results/runtime-nvidia-h200.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cupy as cp
from anchors import ANCHORS
from gemv_dispatch.dispatch.measure.timing import CupyBackend, TimingConfig, copies_for_cold_l2, time_candidates
from gemv_dispatch.dispatch.serve import runtime
from gemv_dispatch.kernels import launch

MS = (1, 16)
CALLS, BATCHES = 400, 15  # per batch: well under the launch queue depth


def device_weights(codebook: str, n: int, k: int, seed: int) -> runtime.Weights:
    """Random device planes wrapped as prepared weights (prepare() would quantize on the CPU: too slow here)."""
    planes = launch.random_weights(codebook, n, k, cp.random.default_rng(seed))
    cp.cuda.Device().synchronize()
    return runtime.Weights(codebook, codebook.lower(), n, k, cp.cuda.runtime.getDevice(), planes)


def host_us(call: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Median host microseconds per call over batches of CALLS calls (the device drained between batches)."""
    samples = []
    for _ in range(BATCHES):
        sync()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call()
        samples.append((time.perf_counter() - t0) / CALLS * 1e6)
    sync()
    return statistics.median(samples)


def overhead(stream: Any, n: int, k: int, m: int) -> dict[str, float]:
    """Host us per call: raw bind launch, runtime.gemv on quantized x, runtime.gemv on x, and torch's."""
    w = device_weights("Q4_0", n, k, 1)
    with stream:
        x = cp.random.default_rng(2).standard_normal((m, k), dtype=cp.float32)
        out = cp.empty((m, n), cp.float32)
        qx = runtime.quantize(x)
        cand = runtime.choice_for(w, m).candidate
        need = cand.workspace_bytes(m, n, k)
        ws = launch.new_workspace(need, n) if need else None
        raw = launch.bind(cand, [w.planes], qx.buffers, out, stream, ws)
        runtime.gemv(w, qx, out=out)  # resolve and cache the launch before timing
        row = {
            "raw_bind_us": host_us(lambda: raw(0), stream.synchronize),
            "gemv_qx_us": host_us(lambda: runtime.gemv(w, qx, out=out), stream.synchronize),
            "gemv_x_us": host_us(lambda: runtime.gemv(w, x, out=out), stream.synchronize),
            "quantize_us": host_us(lambda: runtime.quantize(x), stream.synchronize),
        }
    # A caller on the default stream (no `with stream`): two event records and two waits more per call.
    row["gemv_qx_null_stream_us"] = host_us(lambda: runtime.gemv(w, qx, out=out), cp.cuda.Device().synchronize)
    try:
        import torch
    except ImportError:
        return row
    xt, outt = torch.randn(m, k, device="cuda"), torch.empty(m, n, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        qt = runtime.quantize(xt)
        runtime.gemv(w, qt, out=outt)
        row["torch_gemv_qx_us"] = host_us(lambda: runtime.gemv(w, qt, out=outt), side.synchronize)
    return row


def quantize_device(stream: Any, m: int, k: int) -> dict[str, float]:
    """Eager quantize alone: device us per call (events around back-to-back calls) and host us per call."""
    with stream:
        x = cp.random.default_rng(3).standard_normal((m, k), dtype=cp.float32)
        runtime.quantize(x)
    stats = time_candidates({"quantize": lambda i: runtime.quantize(x)}, 1,
                            TimingConfig(mode="eager", cold_l2=False, race=False, window_us=300.0),
                            CupyBackend(stream))["quantize"]
    with stream:
        host = host_us(lambda: runtime.quantize(x), stream.synchronize)
    return {"device_us": stats.median_us, "host_us": host}


def end_to_end(stream: Any, n: int, k: int, m: int, mode: str, l2: int) -> dict[str, Any]:
    """quantize + gemv through the runtime vs the raw gemv launch of the same candidate, cold L2."""
    first = device_weights("Q4_0", n, k, 10)
    copies = [first] + [device_weights("Q4_0", n, k, 10 + i) for i in range(1, copies_for_cold_l2(
        first.planes.nbytes, l2))]
    with stream:
        x = cp.random.default_rng(4).standard_normal((m, k), dtype=cp.float32)
        out = cp.empty((m, n), cp.float32)
        qx = runtime.quantize(x)
        cand = runtime.choice_for(first, m, mode).candidate
        need = cand.workspace_bytes(m, n, k)
        ws = launch.new_workspace(need, n) if need else None
        raw = launch.bind(cand, [w.planes for w in copies], qx.buffers, out, stream, ws)
        stream.synchronize()

    def through_runtime(i: int) -> None:
        runtime.gemv(copies[i], runtime.quantize(x), out=out)

    config = TimingConfig(mode=mode, cold_l2=True, race=False, window_us=300.0)
    stats = time_candidates({"raw": raw, "runtime": through_runtime}, len(copies), config, CupyBackend(stream))
    return {"codebook": "Q4_0", "m": m, "n": n, "k": k, "mode": mode, "candidate": cand.id,
            "gemv_us": stats["raw"].median_us, "quantize_gemv_us": stats["runtime"].median_us,
            "added_us": stats["runtime"].median_us - stats["raw"].median_us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument("--quick", action="store_true", help="three anchors only (smoke run)")
    args = ap.parse_args()
    warnings.simplefilter("once")  # the no-table warning, shown once: the safe default is what is timed then
    props = cp.cuda.runtime.getDeviceProperties(0)
    device = {"name": props["name"].decode(), "l2_bytes": int(props["l2CacheSize"]),
              "cupy": cp.__version__, "python": sys.version.split()[0]}
    stream = cp.cuda.Stream(non_blocking=True)
    t0 = time.time()
    result: dict[str, Any] = {"device": device, "table": runtime._STATE.dispatcher.table(device["name"]) is not None}
    result["overhead"] = {f"M={m}": overhead(stream, 4096, 4096, m) for m in MS}
    print(json.dumps(result["overhead"]), flush=True)
    result["quantize"] = [{"m": m, "k": k, **quantize_device(stream, m, k)} for m in (1, 4, 16) for k in (4096, 14336)]
    print(json.dumps(result["quantize"]), flush=True)
    anchors = ANCHORS[:3] if args.quick else ANCHORS
    rows = []
    for n, k in anchors:
        for m in MS:
            for mode in ("graph", "eager"):
                rows.append(end_to_end(stream, n, k, m, mode, device["l2_bytes"]))
                print(json.dumps(rows[-1]), flush=True)
                cp.get_default_memory_pool().free_all_blocks()
    result["end_to_end"] = rows
    result["seconds"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"\n{device['name']}, CuPy {device['cupy']}; table installed: {result['table']}")
    print("host us per call (N=K=4096, Q4_0): raw bind | gemv(qx) | +overhead | gemv(x) | quantize | "
          "gemv(qx) on stream 0 | torch gemv(qx)")
    for key, o in result["overhead"].items():
        print(f"  {key:5} {o['raw_bind_us']:8.2f} {o['gemv_qx_us']:9.2f} {o['gemv_qx_us'] - o['raw_bind_us']:+10.2f} "
              f"{o['gemv_x_us']:8.2f} {o['quantize_us']:9.2f} {o['gemv_qx_null_stream_us']:10.2f} "
              f"{o.get('torch_gemv_qx_us', float('nan')):9.2f}")
    print("quantize alone, eager: M K device_us host_us")
    for q in result["quantize"]:
        print(f"  {q['m']:3} {q['k']:6} {q['device_us']:8.2f} {q['host_us']:8.2f}")
    print(f"\n{'M':>3} {'N':>7} {'K':>6} {'mode':6} {'candidate':22} {'gemv us':>8} {'q+gemv us':>10} {'added':>7}")
    for r in rows:
        print(f"{r['m']:>3} {r['n']:>7} {r['k']:>6} {r['mode']:6} {r['candidate']:22} {r['gemv_us']:8.2f} "
              f"{r['quantize_gemv_us']:10.2f} {r['added_us']:+7.2f}")


if __name__ == "__main__":
    main()
