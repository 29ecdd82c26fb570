"""One line per cell from an Nsight Compute text log of bench/profile_candidates.py (no GPU needed).

    python bench/ncu_summary.py bench/results/ncu-v16-h200.log Q4_0:1:4096:4096:direct.s16.t8.c1 ...

The cells are profile_candidates.py's arguments, in its order; each was launched the same number of times, and each
figure is the median over its launches: duration (µs, at the GPU's own clocks with `--clock-control none`), DRAM
throughput (% of peak), SM active cycles over elapsed cycles (the rest is ramp and tail), grid (CTAs), waves per
SM, registers per thread, theoretical / achieved occupancy (%), warps issued per scheduler per cycle, eligible
warps per scheduler, warp cycles per issued instruction, executed instructions, and ncu's first stall remark.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

from gemv_dispatch.kernels.registry import by_id

METRICS = {"Duration": "us", "DRAM Throughput": "dram", "Elapsed Cycles": "elapsed", "SM Active Cycles": "active",
           "Grid Size": "grid", "Waves Per SM": "waves", "Registers Per Thread": "regs",
           "Theoretical Occupancy": "theoretical", "Achieved Occupancy": "achieved",
           "Issued Warp Per Scheduler": "issued", "Eligible Warps Per Scheduler": "eligible",
           "Warp Cycles Per Issued Instruction": "cycles_per_issue", "Executed Instructions": "instructions"}
STALL = re.compile(r"each warp of this workload spends ([\d.]+) cycles being stalled (.+?)\. [A-Z]")


def kernels(text: str) -> list[dict[str, float | str]]:
    """The metrics of every profiled kernel, in launch order."""
    found = []
    for block in re.split(r"\n  void ", text)[1:]:
        row: dict[str, float | str] = {}
        for label, key in METRICS.items():
            if hit := re.search(rf"\n\s+{re.escape(label)}\s+(?:\S+\s+)?([\d,.]+)\n", block):
                row[key] = float(hit.group(1).replace(",", ""))
        stall = STALL.search(re.sub(r"\s+", " ", block))
        reason = stall.group(2).replace("waiting for a scoreboard dependency on a L1TEX (local, global, surface, "
                                        "texture) operation", "on the L1TEX scoreboard") if stall else ""
        row["stall"] = f"{stall.group(1)} of those cycles stalled {reason}" if stall else ""
        found.append(row)
    return found


def summary(text: str, cells: list[str]) -> list[str]:
    rows = kernels(text)
    if not cells or len(rows) % len(cells):
        raise SystemExit(f"{len(rows)} kernels in the log do not split evenly over {len(cells)} cells")
    per = len(rows) // len(cells)
    lines = []
    for i, cell in enumerate(cells):
        group = rows[i * per:(i + 1) * per]
        _, m, n, k, cid = cell.split(":")
        grid, _ = by_id(cid).launch_geometry(int(m), int(n), int(k))
        if any(r.get("grid") != grid[0] * grid[1] * grid[2] for r in group):  # the log's order is not the cells'
            raise SystemExit(f"{cell}: the log's kernels {i * per}..{(i + 1) * per - 1} did not run its grid {grid}")

        def med(key: str, group: list[dict[str, float | str]] = group) -> float:
            return statistics.median(float(r.get(key, float("nan"))) for r in group)

        active = 100 * med("active") / med("elapsed")
        lines.append(f"{cell:38s} {med('us'):7.2f} µs  DRAM {med('dram'):4.1f} %  active {active:4.1f} %  "
                     f"grid {med('grid'):5.0f}  waves {med('waves'):4.2f}  {med('regs'):3.0f} regs  occupancy "
                     f"{med('theoretical'):4.1f}/{med('achieved'):4.1f} %  issued {med('issued'):4.2f}  eligible "
                     f"{med('eligible'):4.2f}  {med('cycles_per_issue'):5.2f} cycles/issue  "
                     f"{med('instructions') / 1e6:5.2f} M instr  {group[0]['stall']}")
    return lines


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1]).read_text(), sys.argv[2:])))
