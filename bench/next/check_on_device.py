"""The staged kernel source (bench/next/gemv.cu) on a GPU, bytes first, then speed, in one run.

    python bench/next/check_on_device.py --out $OUT/next.json [--seed S] [--skip-speed]

1. Bytes: for every codebook (kernels.codebooks.FORMATS) on two shapes (one whose partitions cut Q4_K/Q5_K
   pairs and Q6_K quads), every staged candidate at M in 1..16 and 31 must equal the emulator as uint32
   (outputs and kpar workspaces poisoned), which makes grouped M equal to serial M = 1; for the legacy codebooks
   it must also equal the registered kernels of the package on the same device planes. Negative control: a
   result of S = 1 against the emulator's S = 8 must differ.
2. Speed: the super-block codebooks and Q4_0 on the anchors at M = 1, 8 and 16: the best staged candidate,
   timed as the sweep times a cell (cold L2 by rotation, CUDA-graph replays, interleaved rounds, medians),
   against the read ceiling, cuBLAS fp16 (M > 1) and, for Q4_0, the registered kernels in the same rounds (the
   staged tensor-core engine streams 4-bit formats through the shared-memory ring).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[2] / "tests")]
from anchors import ANCHORS  # noqa: E402
from gemv_dispatch.dispatch.timing import CupyBackend, cell_seed, copies_for_cold_l2, time_candidates  # noqa: E402
from gemv_dispatch.kernels import emulate, launch, layout, program  # noqa: E402
from gemv_dispatch.kernels.codebooks import CODEBOOKS, FORMATS, SUPERBLOCK, quantize  # noqa: E402
from gemv_dispatch.kernels.errors import BLOCK  # noqa: E402
from gemv_dispatch.kernels.registry import CANDIDATES, MMA_ROWS, Candidate  # noqa: E402
from hostsim import STAGED_SOURCE, codebook_index, ticket_words  # noqa: E402

from kernels import CONFIG, TorchBackend, read_ceiling, time_baselines  # noqa: E402

BYTE_SHAPES = [(1032, 4096), (264, 1280)]  # ragged CTAs; KB = 40: partitions of 5 and 10 blocks
BYTE_MS = [*range(1, 17), 31]
SPEED_MS = (1, 8, 16)
SPEED_CODEBOOKS = ("Q4_0", *SUPERBLOCK)
POISON = np.uint32(0x7FC0DEAD)  # a NaN no kernel writes


@cache
def staged_planes() -> tuple[str, ...]:
    return program.declared_planes(STAGED_SOURCE.read_text())


@cache
def module(codebook: str) -> Any:
    index = codebook_index(codebook)
    names = sorted({c.template_name(index, m) for c in CANDIDATES for m in range(1, 2 * MMA_ROWS + 1)})
    return cp.RawModule(code=STAGED_SOURCE.read_text(), options=program.CONTRACT_OPTIONS, name_expressions=names)


def workspace_floats(c: Candidate, m: int, n: int, k: int) -> int:
    """kpar's workspace in the staged kernels: the tickets (ticket_words), then the partials [S][M][N]."""
    return ticket_words(n) + c.workspace_bytes(m, n, k) // 4 if c.grid_split else 0


def enqueue(c: Candidate, w: launch.DeviceWeights, qact: Any, out: Any, ws: Any, stream: Any) -> None:
    """The staged kernel of candidate `c` on `stream`: y = W·x into `out`; kpar folds in the same launch through
    `ws` (workspace_floats, tickets zero), which it leaves zero."""
    m, n, k = qact.m, w.n, w.k
    grid, block = c.launch_geometry(m, n, k)
    kernel = module(w.codebook).get_function(c.template_name(codebook_index(w.codebook), m))
    scalars = (np.int32(m), np.int32(n), np.int32(k // BLOCK), np.int32(c.partition_width(k)))
    kernel(grid, block, (*w.plane_args(staged_planes()), *launch.storage(qact), *scalars, out,
                         ws if c.grid_split else np.uint64(0)),
           shared_mem=c.shared_bytes(m), stream=stream)


def poisoned(*shape: int) -> Any:
    return cp.full(shape, POISON, cp.uint32).view(cp.float32)


def run(c: Candidate, w: launch.DeviceWeights, qact: Any, stream: Any) -> Any:
    """A poisoned output, and for kpar a workspace of poisoned partials and zero tickets, which must stay zero."""
    m, n, k = qact.m, w.n, w.k
    out, ws = poisoned(m, n), None
    if c.grid_split:
        ws = poisoned(workspace_floats(c, m, n, k))
        ws[: ticket_words(n)] = 0
    enqueue(c, w, qact, out, ws, stream)
    if ws is not None and bool(ws[: ticket_words(n)].view(cp.uint32).any()):
        raise AssertionError(f"{c.id}: the kpar tickets were not reset")
    return out


def same(a: Any, b: Any) -> bool:
    return bool((a.view(cp.uint32) == b.view(cp.uint32)).all())


def check_bytes(seed: int, stream: Any) -> dict[str, Any]:
    """Every device operation on `stream` (allocations, poison, comparisons), so each is ordered with the launches."""
    with stream:
        return _check_bytes(seed, stream)


def _check_bytes(seed: int, stream: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    compared, failures, controls = 0, [], []
    for cb in FORMATS:
        for n, k in BYTE_SHAPES:
            w = rng.standard_normal((n, k), dtype=np.float32) * rng.uniform(0.01, 2, (n, 1)).astype(np.float32)
            packed = layout.pack(cb, quantize(cb, w), n, k)
            x = rng.standard_normal((max(BYTE_MS), k), dtype=np.float32)
            x[:, :32] = 0.0
            x[:, 32:64] *= np.float32(1e-40)  # subnormal activations
            qa = emulate.quantize_activations(x)
            expected = {s: cp.asarray(emulate.gemv_quantized(packed, qa, s))
                        for s in sorted({c.split(k) for c in CANDIDATES if c.valid(1, n, k)})}
            planes = launch.to_device(packed)
            xs = cp.asarray(x)
            for m in BYTE_MS:
                qact = launch.quantize_activations(xs[:m], stream)
                for c in CANDIDATES:
                    if not c.valid(m, n, k):
                        continue
                    got = run(c, planes, qact, stream)
                    compared += 1
                    if not same(got, expected[c.split(k)][:m]):
                        failures.append(f"{cb} {n}x{k} M={m} {c.id}: differs from the emulator")
                    if cb in CODEBOOKS:  # the registered kernel on the same planes
                        ref = poisoned(m, n)
                        ws = poisoned(max(c.workspace_bytes(m, n, k) // 4, 1))
                        launch.gemv(c, planes, qact, ref, stream, workspace=ws if c.grid_split else None)
                        if not same(got, ref):
                            failures.append(f"{cb} {n}x{k} M={m} {c.id}: differs from the registered kernel")
                wide = next(c for c in CANDIDATES if c.family == "wide" and c.valid(m, n, k))
                if 8 in expected:
                    controls.append(not same(run(wide, planes, qact, stream), expected[8][:m]))
            stream.synchronize()
        print(f"bytes {cb}: {compared} compared so far, {len(failures)} failures", flush=True)
    return {"seed": seed, "compared": compared, "failures": failures, "negative_controls": len(controls),
            "negative_controls_differing": sum(controls)}


def time_cell(codebook: str, m: int, n: int, k: int, copies: list[launch.DeviceWeights],
              stream: Any) -> dict[str, float]:
    """Median µs of every staged candidate and, for the legacy formats, every registered one (ids prefixed
    `registered:`), interleaved in the same rounds."""
    cands = [c for c in CANDIDATES if c.valid(m, n, k)]
    with stream:
        qact = launch.quantize_activations(cp.random.default_rng(m).standard_normal((m, k), dtype=cp.float32), stream)
        out = cp.empty((m, n), cp.float32)
        # Zeros: the staged kpar's tickets start at zero and every launch leaves them so; the registered kpar
        # launches write their partials from the start of it, over the staged tickets, so they get their own.
        ws = cp.zeros(max(max(workspace_floats(c, m, n, k) for c in cands), 1), cp.float32)
    launches = {c.id: (lambda i, c=c: enqueue(c, copies[i], qact, out, ws, stream)) for c in cands}
    if codebook in CODEBOOKS:
        with stream:
            ws_registered = cp.empty(max(max(c.workspace_bytes(m, n, k) for c in cands) // 4, 1), cp.float32)
        launches |= {f"registered:{c.id}": launch.bind(c, copies, qact, out, stream,
                                                       ws_registered if c.grid_split else None) for c in cands}
    config = replace(CONFIG, mode="graph")
    stats = time_candidates(launches, len(copies), config, CupyBackend(stream), seed=cell_seed(codebook, m, n, k))
    return {cid: s.median_us for cid, s in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    print(f"seed {args.seed}", flush=True)
    stream = cp.cuda.Stream(non_blocking=True)
    start = time.monotonic()
    result: dict[str, Any] = {"bytes": check_bytes(args.seed, stream)}
    print(f"bytes: {json.dumps(result['bytes'])[:2000]} ({time.monotonic() - start:.0f} s)", flush=True)
    rows = []
    if not args.skip_speed:
        props = cp.cuda.runtime.getDeviceProperties(0)
        l2, sms = int(props["l2CacheSize"]), int(props["multiProcessorCount"])
        ceiling = read_ceiling(l2, sms, stream)
        result["read_ceiling_gbs"] = ceiling
        backend = TorchBackend()
        for cb in SPEED_CODEBOOKS:
            for n, k in ANCHORS:
                rng = cp.random.default_rng(cell_seed(cb, n, k))
                with stream:
                    first = launch.random_weights(cb, n, k, rng)
                    more = copies_for_cold_l2(first.nbytes, l2) - 1
                    copies = [first, *(launch.random_weights(cb, n, k, rng) for _ in range(more))]
                stream.synchronize()
                for m in SPEED_MS:
                    times = time_cell(cb, m, n, k, copies, stream)
                    best = min((c for c in times if ":" not in c), key=times.__getitem__)
                    registered = [times[c] for c in times if c.startswith("registered:")]
                    # The planes hold the GGUF bytes once (a lossless shuffle): what the kernel must read.
                    row = {"codebook": cb, "m": m, "n": n, "k": k, "best": best, "us": times[best],
                           "of_ceiling": first.nbytes / times[best] / 1e3 / ceiling, "times": times,
                           "registered_us": min(registered) if registered else None}
                    if m > 1:
                        row["cublas_fp16_us"] = time_baselines(m, n, k, l2, backend)["cublas_fp16"]
                    rows.append(row)
                    print(json.dumps({key: v for key, v in row.items() if key != "times"}), flush=True)
                del copies, first
                cp.get_default_memory_pool().free_all_blocks()
    result["speed"] = rows
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    b = result["bytes"]
    print(f"\nbytes: {b['compared']} compared, {len(b['failures'])} failures, negative controls differing "
          f"{b['negative_controls_differing']}/{b['negative_controls']}; {time.monotonic() - start:.0f} s")
    if rows:
        print(f"read ceiling {result['read_ceiling_gbs']:.0f} GB/s")
        print("codebook  M       N      K  best                           us  ceil%  x fp16  x registered")
        for r in rows:
            fp16 = r.get("cublas_fp16_us", float("nan")) / r["us"]
            reg = (r["registered_us"] or float("nan")) / r["us"]
            print(f"{r['codebook']:7s} {r['m']:2d} {r['n']:7d} {r['k']:6d}  {r['best']:24s} {r['us']:8.2f} "
                  f"{100 * r['of_ceiling']:6.1f} {fp16:7.2f} {reg:13.2f}")


if __name__ == "__main__":
    main()
