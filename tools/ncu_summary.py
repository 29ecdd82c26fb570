"""One line per cell from an Nsight Compute text log of tools/profile_candidates.py (no GPU needed).

    python tools/ncu_summary.py tests/data/ncu-v16-h200.log Q4_0:1:4096:4096:direct.s16.t8.c1 ...

The cells are profile_candidates.py's arguments, in its order (a candidate CODEBOOK:M:N:K:CANDIDATE, or the streaming
read stream:BYTES:GRID); each was launched the same number of times, and each figure is the median over its
launches. Each cell's grid is checked against the log's, so a cell list in another order is refused.

A log of ncu's sections (`--section ...`, NOTES.md's first table) gives: duration (µs, at the GPU's own clocks with
`--clock-control none`), DRAM throughput (% of peak), SM active cycles over elapsed cycles (the rest is ramp and
tail), grid (CTAs), waves per SM, registers per thread, theoretical / achieved occupancy (%), warps issued per
scheduler per cycle, eligible warps per scheduler, warp cycles per issued instruction, executed instructions, and
ncu's first stall remark. A log of `--metrics` (METRIC_NAMES) gives the bytes read from DRAM and what keeps them in
flight: duration, DRAM MB read and % of peak, SM active %, waves, active warps (% of the SM's slots), L2 sectors per
request from L1, executed instructions.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

from gemv_dispatch.kernels.registry import by_id

METRICS = {"Duration": "us", "DRAM Throughput": "dram", "Elapsed Cycles": "elapsed", "SM Active Cycles": "active",
           "Waves Per SM": "waves", "Registers Per Thread": "regs",
           "Theoretical Occupancy": "theoretical", "Achieved Occupancy": "achieved",
           "Issued Warp Per Scheduler": "issued", "Eligible Warps Per Scheduler": "eligible",
           "Warp Cycles Per Issued Instruction": "cycles_per_issue", "Executed Instructions": "instructions"}
# The --metrics that lab/journal.md's streaming comparison was profiled with, and their keys here.
METRIC_NAMES = {"gpu__time_duration.sum": "us", "dram__bytes_read.sum": "dram_mb",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram", "sm__cycles_active.avg": "active",
                "gpc__cycles_elapsed.max": "elapsed", "launch__waves_per_multiprocessor": "waves",
                "sm__warps_active.avg.pct_of_peak_sustained_active": "warps",
                "lts__t_sectors_srcunit_tex_op_read.sum": "l2_sectors",
                "lts__t_requests_srcunit_tex_op_read.sum": "l2_requests", "smsp__inst_executed.sum": "instructions"}
HEADER = re.compile(r"\n(?=  \S[^\n]*\((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\))")
STALL = re.compile(r"each warp of this workload spends ([\d.]+) cycles being stalled (.+?)\. [A-Z]")
SCALE = {"us": 1.0, "ns": 1e-3, "ms": 1e3, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}


def kernels(text: str) -> list[dict[str, float | str]]:
    """The metrics of every profiled kernel, in launch order, with its grid (CTAs)."""
    found = []
    parts = HEADER.split(text)
    for i in range(1, len(parts), 7):  # a split yields the 6 captured grid and block sizes, then the block
        grid, block = [int(g) for g in parts[i:i + 3]], parts[i + 6]
        row: dict[str, float | str] = {"grid": grid[0] * grid[1] * grid[2]}
        for label, key in (METRICS | METRIC_NAMES).items():  # a value in the units of SCALE where it has one
            if hit := re.search(rf"\n\s+{re.escape(label)}\s+(\S+\s+)?([\d,.]+)\n", block):
                row[key] = float(hit.group(2).replace(",", "")) * SCALE.get((hit.group(1) or "").strip(), 1.0)
        stall = STALL.search(re.sub(r"\s+", " ", block))
        reason = stall.group(2).replace("waiting for a scoreboard dependency on a L1TEX (local, global, surface, "
                                        "texture) operation", "on the L1TEX scoreboard") if stall else ""
        row["stall"] = f"{stall.group(1)} of those cycles stalled {reason}" if stall else ""
        found.append(row)
    return found


def cell_grid(cell: str) -> int:
    """CTAs of a cell's launch: the candidate's main launch, or the streaming read's grid."""
    if cell.startswith("stream:"):
        return int(cell.split(":")[2])
    _, m, n, k, cid = cell.split(":")
    grid, _ = by_id(cid).launch_geometry(int(m), int(n), int(k))
    return grid[0] * grid[1] * grid[2]


def summary(text: str, cells: list[str]) -> list[str]:
    rows = kernels(text)
    if not cells or len(rows) % len(cells):
        raise SystemExit(f"{len(rows)} kernels in the log do not split evenly over {len(cells)} cells")
    per = len(rows) // len(cells)
    lines = []
    for i, cell in enumerate(cells):
        group = rows[i * per:(i + 1) * per]
        ctas = cell_grid(cell)
        if any(r["grid"] != ctas for r in group):  # the log's order is not the cells'
            raise SystemExit(f"{cell}: the log's kernels {i * per}..{(i + 1) * per - 1} did not run its grid "
                             f"of {ctas} CTAs")

        def med(key: str, group: list[dict[str, float | str]] = group) -> float:
            return statistics.median(float(r.get(key, float("nan"))) for r in group)

        active = 100 * med("active") / med("elapsed")
        if "dram_mb" in group[0]:
            lines.append(f"{cell:38s} {med('us'):7.2f} µs  DRAM {med('dram_mb'):6.1f} MB {med('dram'):4.1f} %  "
                         f"active {active:4.1f} %  grid {med('grid'):6.0f}  waves {med('waves'):5.2f}  warps "
                         f"{med('warps'):4.1f} %  L2 sectors/request {med('l2_sectors') / med('l2_requests'):3.1f}  "
                         f"{med('instructions') / 1e6:5.2f} M instr")
            continue
        lines.append(f"{cell:38s} {med('us'):7.2f} µs  DRAM {med('dram'):4.1f} %  active {active:4.1f} %  "
                     f"grid {med('grid'):5.0f}  waves {med('waves'):4.2f}  {med('regs'):3.0f} regs  occupancy "
                     f"{med('theoretical'):4.1f}/{med('achieved'):4.1f} %  issued {med('issued'):4.2f}  eligible "
                     f"{med('eligible'):4.2f}  {med('cycles_per_issue'):5.2f} cycles/issue  "
                     f"{med('instructions') / 1e6:5.2f} M instr  {group[0]['stall']}")
    return lines


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1]).read_text(), sys.argv[2:])))
