"""Do two corpora of one GPU model agree within the noise band? (a fleet sweep against a single-GPU one)

    python tools/compare_corpora.py REFERENCE OTHER [--json OUT]

For every cell both hold (each averaged over its provenances by `train.Measurements`): the per-candidate median
ratio OTHER / REFERENCE, and the decision test that matters for a dispatch table — the regret in REFERENCE of
OTHER's fastest candidate (and the converse). A cell agrees when that regret is within the noise band of the
timing parameters (`noise_rel`, 2 % by default). Prints a summary line per comparison; --json writes it all.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path

from gemv_dispatch.dispatch.learn.train import Measurements
from gemv_dispatch.dispatch.measure.corpus import load


def cell_times(folder: Path) -> tuple[Mapping[tuple, Mapping[str, float]], float]:
    """Cell -> candidate -> median µs averaged over provenances, and the noise band: as `train` reads a corpus."""
    measured = Measurements.from_corpus(load(folder))
    return measured.times, measured.noise_rel


def regret(times: dict[str, float], pick: str) -> float:
    return times[pick] / min(times.values()) - 1.0


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def compare(reference: Path, other: Path) -> dict:
    ref, noise_ref = cell_times(reference)
    oth, noise_oth = cell_times(other)
    noise = max(noise_ref, noise_oth)
    common = sorted(set(ref) & set(oth), key=str)
    # Racing drops clearly slower candidates early: compare each cell over the candidates both kept.
    ref = {c: {k: t for k, t in ref[c].items() if k in oth[c]} for c in common}
    oth = {c: {k: t for k, t in oth[c].items() if k in ref[c]} for c in common}
    ratios = [oth[c][k] / ref[c][k] for c in common for k in ref[c]]
    cross = [regret(ref[c], min(oth[c], key=oth[c].get)) for c in common]
    back = [regret(oth[c], min(ref[c], key=ref[c].get)) for c in common]
    worst = max(common, key=lambda c: regret(ref[c], min(oth[c], key=oth[c].get))) if common else None
    return {
        "reference": str(reference), "other": str(other), "cells": len(common), "noise_rel": noise,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "ratio_p5_p95": [quantile(ratios, 0.05), quantile(ratios, 0.95)] if ratios else None,
        "winner_regret_in_reference": {"geomean": math.exp(statistics.fmean(math.log1p(x) for x in cross)) - 1,
                                       "p95": quantile(cross, 0.95), "max": max(cross)} if cross else None,
        "cells_within_noise": sum(x <= noise for x in cross) / len(cross) if cross else None,
        "cells_within_noise_converse": sum(x <= noise for x in back) / len(back) if back else None,
        "worst_cell": list(worst) if worst else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args()
    result = compare(args.reference, args.other)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    w = result["winner_regret_in_reference"]
    print(f"{result['cells']} common cells; median time ratio {result['median_ratio']:.4f} "
          f"(p5 {result['ratio_p5_p95'][0]:.3f}, p95 {result['ratio_p5_p95'][1]:.3f}); other's winner in the "
          f"reference: regret geomean {100 * w['geomean']:.2f} %, p95 {100 * w['p95']:.2f} %, max "
          f"{100 * w['max']:.2f} % ({result['worst_cell']}); within the {100 * result['noise_rel']:.0f} % band: "
          f"{100 * result['cells_within_noise']:.1f} % (converse {100 * result['cells_within_noise_converse']:.1f} %)")


if __name__ == "__main__":
    main()
