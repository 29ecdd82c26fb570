"""Experiment (not in the registry): does the grid's balance over the SMs cap M = 1 at S = 1? (CTA widths)

    python lab/experiments/grid_balance.py --codebooks Q4_K,IQ4_XS --shapes 27648x5120 --out balance.json

At S = 1 every registry launch of 27648 columns puts at most 256 columns on an SM of 132 where the mean is 209
(`wide.s1.t256`: 108 CTAs; `t128`: 216, two on 84 SMs; kpar and direct tiles of 64: 432, four on 36 SMs), so where
the SMs' decode sets the pace, not the bytes, the launch cannot pass 209 / 256 = 82 % of the SMs' rate. The staged
wide walk (`gemv_staged`, the ring where the walk is long) runs at any CTA width of whole warps with S = 1's bytes:
this times it at the WIDTHS below beside the registry's candidates and the streaming read of the same bytes, after
every variant's output is compared byte for byte with the registry's `wide.s1.t128.c1.st`. Each variant is printed
with its balance, the mean columns per SM over the most any SM holds (CTAs spread evenly, all resident at once).
"""

from __future__ import annotations

from typing import Any

from gemv_dispatch.kernels.registry import Candidate, by_id
from walk_read import REFERENCE, arguments, bound, cell_inputs, checked_medians, study

WIDTHS = (32, 64, 96, 128, 160, 192, 224, 256)  # threads (columns) per CTA, whole warps


def balance(n: int, threads: int, sms: int) -> float:
    """Mean columns per SM over the most one SM holds, with the CTAs of `threads` columns spread evenly."""
    ctas = -(-n // threads)
    return n / sms / (-(-ctas // sms) * threads)


def time_cell(codebook: str, n: int, k: int, candidates: list[str], l2: int, sms: int,
              stream: Any) -> dict[str, float]:
    """Medians (µs) of the variants, the candidates and the stream of one cell, timed in one interleaved run."""
    copies, qact, ws = cell_inputs(codebook, n, k, candidates, l2, stream)
    widths = {t: Candidate("wide", 1, t, 1, staged=True) for t in WIDTHS}
    chosen = {f"{c.id}.b{balance(n, t, sms):.2f}": c for t, c in widths.items() if c.valid(1, n, k)}
    chosen |= {c: by_id(c) for c in dict.fromkeys([REFERENCE, *candidates])}
    launches, outs = bound(chosen, copies, qact, ws, stream)
    s1 = [name for name, cand in chosen.items() if cand.split(k) == 1]
    return checked_medians(codebook, n, k, launches, outs, s1, copies, sms, stream)


def main() -> None:
    args = arguments(__doc__, "CTA widths")
    study(args, time_cell, widths=list(WIDTHS), reference=REFERENCE)


if __name__ == "__main__":
    main()
