"""CPU emulator benchmark: wall time of kernels.emulate.gemv (the bit-exact oracle of docs/contract.md §1) at a
typical certification shape, against the goal of at most 2 s per call.

Weights are codebooks.quantize of Gaussian data, packed with layout.pack, and activations are Gaussian;
all of it is made outside the timed region. Each (codebook, ksplit) is timed `--repeats` times with
time.perf_counter and the median is reported.

    python bench/emulator.py                       # N = K = 4096, M = 16, Q4_0 and Q5_1, ksplit 1 and 8
    python bench/emulator.py --codebooks all --m 31
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from gemv_dispatch.kernels import emulate
from gemv_dispatch.kernels.codebooks import CODEBOOKS, get, quantize
from gemv_dispatch.kernels.errors import BLOCK, InputError
from gemv_dispatch.kernels.layout import pack

GOAL_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096, help="output rows N (default 4096)")
    p.add_argument("--k", type=int, default=4096, help="reduction length K, a multiple of 32 (default 4096)")
    p.add_argument("--m", type=int, default=16, help="activation rows M (default 16)")
    p.add_argument(
        "--codebooks", default="Q4_0,Q5_1", help=f"comma-separated, or 'all' ({', '.join(CODEBOOKS)})"
    )
    p.add_argument("--ksplits", default="1,8", help="comma-separated ksplit values (default 1,8)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n <= 0 or args.m <= 0 or args.k <= 0 or args.k % BLOCK:
        p.error(f"need N, M > 0 and K a positive multiple of 32, got N={args.n}, M={args.m}, K={args.k}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    try:
        names = CODEBOOKS if args.codebooks == "all" else args.codebooks.split(",")
        args.codebooks = [get(c).name for c in names]
    except InputError as err:
        p.error(str(err))
    try:
        args.ksplits = [int(s) for s in args.ksplits.split(",")]
    except ValueError:
        p.error(f"--ksplits must be comma-separated integers, got {args.ksplits!r}")
    if min(args.ksplits) < 1:
        p.error("every ksplit must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.m, args.k)).astype(np.float32)
    kb = args.k // BLOCK
    print(f"kernels.emulate.gemv  N={args.n} K={args.k} M={args.m}  median of {args.repeats} runs")
    header = f"{'codebook':<9} {'ksplit':>6} {'S':>4} {'median s':>9} {'min s':>7} {'max s':>7}"
    print(f"{header}  goal <= {GOAL_S:g} s")
    failed = 0
    for codebook in args.codebooks:
        w = rng.standard_normal((args.n, args.k)).astype(np.float32)
        packed = pack(codebook, quantize(codebook, w), args.n, args.k)
        for ksplit in args.ksplits:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                emulate.gemv(packed, x, ksplit)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            ok = med <= GOAL_S
            failed += not ok
            s_eff = emulate.effective_split(kb, ksplit)
            spread = f"{min(times):>7.3f} {max(times):>7.3f}"
            verdict = "ok" if ok else "MISSED"
            print(f"{packed.codebook:<9} {ksplit:>6} {s_eff:>4} {med:>9.3f} {spread}  {verdict}")
    print("all within the goal" if not failed else f"{failed} case(s) over the {GOAL_S:g} s goal")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
