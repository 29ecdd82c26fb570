"""Experiment (not in the registry): does the grid's balance over the SMs cap M = 1 at S = 1? (CTA widths)

    python bench/grid_balance.py --codebooks Q4_K,IQ4_XS --shapes 27648x5120 --out bench/results/balance.json

At S = 1 every registry launch of 27648 columns puts at most 256 columns on an SM of 132 where the mean is 209
(`wide.s1.t256`: 108 CTAs; `t128`: 216, two on 84 SMs; kpar and direct tiles of 64: 432, four on 36 SMs), so where
the SMs' decode sets the pace, not the bytes, the launch cannot pass 209 / 256 = 82 % of the SMs' rate. The staged
wide walk (`gemv_staged`, the ring where the walk is long) runs at any CTA width of whole warps with S = 1's bytes:
this times it at the WIDTHS below beside the registry's candidates and the streaming read of the same bytes, after
every variant's output is compared byte for byte with the registry's `wide.s1.t128.c1.st`. Each variant is printed
with its balance, the mean columns per SM over the most any SM holds (CTAs spread evenly, all resident at once).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import cupy as cp
import numpy as np
from gemv_dispatch.dispatch.timing import CupyBackend, cell_seed, time_candidates
from gemv_dispatch.kernels import launch
from gemv_dispatch.kernels.registry import Candidate, by_id
from walk_read import arguments, cell_inputs, stream_launches, study

from kernels import CONFIG

REFERENCE = "wide.s1.t128.c1.st"  # S = 1 in the registry
WIDTHS = (32, 64, 96, 128, 160, 192, 224, 256)  # threads (columns) per CTA, whole warps


def variant(threads: int) -> Candidate:
    return Candidate("wide", 1, threads, 1, staged=True)


def balance(n: int, threads: int, sms: int) -> float:
    """Mean columns per SM over the most one SM holds, with the CTAs of `threads` columns spread evenly."""
    ctas = -(-n // threads)
    return n / sms / (-(-ctas // sms) * threads)


def time_cell(codebook: str, n: int, k: int, candidates: list[str], l2: int, sms: int,
              stream: Any) -> dict[str, float]:
    """Medians (µs) of the variants, the candidates and the stream of one cell, timed in one interleaved run."""
    copies, qact, ws = cell_inputs(codebook, n, k, candidates, l2, stream)
    launches, outs = {}, {}
    chosen = {f"{variant(t).id}.b{balance(n, t, sms):.2f}": variant(t) for t in WIDTHS if variant(t).valid(1, n, k)}
    chosen |= {c: by_id(c) for c in dict.fromkeys([REFERENCE, *candidates])}
    for name, cand in chosen.items():
        with stream:
            outs[name] = cp.full((1, n), np.nan, cp.float32)
        launches[name] = launch.bind(cand, copies, qact, outs[name], stream, ws)
        launches[name](0)
    stream.synchronize()
    expected = cp.asnumpy(outs[REFERENCE]).view(np.uint32)
    for name, cand in chosen.items():
        if cand.split(k) == 1 and not np.array_equal(cp.asnumpy(outs[name]).view(np.uint32), expected):
            raise SystemExit(f"{codebook} {n}x{k} {name}: the output differs from {REFERENCE}'s (S = 1)")
    launches |= stream_launches(copies, sms, stream)
    stats = time_candidates(launches, len(copies), replace(CONFIG, race=False), CupyBackend(stream),
                            seed=cell_seed(codebook, 1, n, k))
    return {name: st.median_us for name, st in stats.items()}


def main() -> None:
    args = arguments(__doc__, "CTA widths")
    study(args, time_cell, widths=list(WIDTHS), reference=REFERENCE)


if __name__ == "__main__":
    main()
