"""Whether the working tree's kernel source beats the baseline over tools/source_ab.py runs, as a device call decides
before it sweeps (a kernel change is registered by a sweep of its own source, so the call must know which source
to sweep without a round trip here).

    python3 tools/ab_decide.py ab-direct.json ab-kpar.json ... [--worst 1.03]

Per cell (codebook, M, N, K) over every file given: the best candidate of each version (the source_ab runs of one
family each, so the best over the files is the best a table could pick among those families), the tree's time over
the baseline's. The baseline is the first source each run names (`sources[0]`, by file stem, as source_ab labels
it); every file must name the same one. Prints one line per cell and the verdict; exit 0 to keep the tree's source
(geomean below --geomean, default 1, and no cell slower than --worst), 1 to keep the baseline's, 2 on unusable input
or when the tree would be kept but a run cut by its time limit left requested cells unmeasured (a run that names its
`requested` cells, as source_ab writes them): an unmeasured codebook may hide the regression the rule looks for.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

TREE = "tree"  # source_ab's label of the working tree's source


@dataclass(frozen=True)
class Verdict:
    ratios: dict[tuple[str, int, int, int], float]  # tree / baseline, best candidate per cell
    geomean: float
    worst: float
    keep_tree: bool
    unmeasured: tuple[tuple[str, str, int], ...] = ()  # (family, codebook, M) slices a cut run did not finish

    @property
    def exit_code(self) -> int:
        """0: keep the tree's source, 1: the baseline's (the cells measured suffice), 2: no verdict (the tree would be
        kept, but requested cells were not measured)."""
        return 1 if not self.keep_tree else 2 if self.unmeasured else 0


CHOICES = ("keep the tree's source", "keep the baseline's source",
           "no verdict: the tree's cells are faster, but requested cells were not measured")


def baseline_label(runs: list[dict]) -> str:
    labels = {Path(run["sources"][0]).stem for run in runs}
    if len(labels) != 1:
        raise ValueError(f"the runs name different baselines: {', '.join(sorted(labels))}")
    return labels.pop()


def decide(runs: list[dict], worst_allowed: float, geomean_below: float = 1.0) -> Verdict:
    """The verdict over source_ab JSON runs (their `rows`: codebook, m, n, k, candidate, us by version label)."""
    base = baseline_label(runs)
    best: dict[tuple[str, int, int, int], dict[str, float]] = {}
    for run in runs:
        for row in run["rows"]:
            cell = (row["codebook"], row["m"], row["n"], row["k"])
            times = best.setdefault(cell, {base: math.inf, TREE: math.inf})
            for label in (base, TREE):
                times[label] = min(times[label], row["us"].get(label, math.inf))  # a version may lack a launch
    ratios = {cell: t[TREE] / t[base] for cell, t in sorted(best.items()) if math.isfinite(t[TREE] / t[base])}
    if not ratios:
        raise ValueError("no cell has times of both versions")
    geomean = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
    worst = max(ratios.values())
    return Verdict(ratios, geomean, worst, geomean < geomean_below and worst <= worst_allowed, unmeasured(runs))


def unmeasured(runs: list[dict]) -> tuple[tuple[str, str, int], ...]:
    """The (family, codebook, M) slices with a requested cell that no row of its run measured."""
    out = set()
    for run in runs:
        requested = run.get("requested")
        if requested is None:  # a run from before source_ab named its request
            continue
        measured = {(row["codebook"], row["m"], row["n"], row["k"]) for row in run["rows"]}
        out |= {(requested["family"], cb, m) for cb, m, n, k in requested["cells"] if (cb, m, n, k) not in measured}
    return tuple(sorted(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="tools/source_ab.py --out files")
    parser.add_argument("--worst", type=float, default=1.03, help="the slowest cell the tree may have (tree/base)")
    parser.add_argument("--geomean", type=float, default=1.0,
                        help="the geomean (tree/base) to beat; below 1 when the tree's new launches cost sweep time")
    args = parser.parse_args(argv)
    try:
        verdict = decide([json.loads(path.read_text()) for path in args.runs], args.worst, args.geomean)
    except (OSError, ValueError, KeyError, IndexError) as problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    for (codebook, m, n, k), ratio in verdict.ratios.items():
        print(f"{codebook} M={m} {n}x{k}: {ratio:.3f}")
    for family, codebook, m in verdict.unmeasured:
        print(f"not measured (the run was cut): {family} {codebook} M={m}")
    print(f"{len(verdict.ratios)} cells, geomean {verdict.geomean:.3f}, worst {verdict.worst:.3f}: "
          f"{CHOICES[verdict.exit_code]}")
    return verdict.exit_code


if __name__ == "__main__":
    sys.exit(main())
