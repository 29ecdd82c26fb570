"""Study (CPU, corpus only): where the price of invariance comes from, and which launches would remove it.

    python lab/experiments/invariance_study.py corpus/nvidia-h200 --json lab/results/invariance-nvidia-h200.json \
        [--policy generated/nvidia-h200/policy.json] [--bench bench/results/kernels-nvidia-h200.json]

The price of invariance (docs/policy.md §6) is, per measured cell, the time of the best launch of the one identity
the table keeps for its (codebook, N, K) over the cell's fastest launch of any identity. This script
1. reproduces train's figures: identities chosen as `train` chooses them (`Measurements`, its `TimeModel`,
   `score` over the default profile: about 2 minutes of fitting on 2 cores), the price on the measured cells
   (`evaluate.invariant_ratios`) and over the profile (`evaluate._price`: unmeasured M from the time model);
   with --policy it also prices a committed table's own identities;
2. attributes the loss (the sum over cells of log(ratio), whose mean is the log of the geomean) to groups of
   (M, kept identity S, fastest launch's family, engine and S);
3. prices proposals: launches the registry lacks, each a predicate on (cell, kept S, fastest launch). A proposal
   assumes the new launch produces the kept identity at the time of the fastest existing launch of the cells it
   covers, so the price after it is a LOWER bound (the gain an upper bound), with the identities kept as they are;
4. answers the small-M question on the anchors of >= 30 MB (of Q4_0 weights, bench/kernels_report.py's rule):
   time at M over time at M = 1 of the best launch, from the corpus (M = 4 only: it holds M in {1, 4, 16}) and,
   with --bench, from a kernel-benchmark run (which times M = 2, 4, 8 for Q4_0 and Q8_0).
Reads only; writes the JSON named by --json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gemv_dispatch.dispatch.learn import evaluate
from gemv_dispatch.dispatch.learn.policy import DEFAULT_PROFILE
from gemv_dispatch.dispatch.learn.policy import load as load_policy
from gemv_dispatch.dispatch.learn.train import Measurements, TimeModel, best_launch, score, serving
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.kernels.registry import BY_ID, CANDIDATES, instantiations, mma_row_tiles, row_tile

ANCHORS = [(4096, 4096), (14336, 4096), (4096, 14336), (5120, 5120), (27648, 5120), (5120, 27648),
           (151936, 4096), (1024, 4096), (512, 2048)]  # bench/anchors.py
BIG_BYTES = 30e6  # "anchors of >= 30 MB": of Q4_0 weights (18 bytes per 32), bench/kernels_report.py's rule
SMALL_M = {"q4_0", "q4_k", "q6_k", "q8_0"}
SMALL_M_TARGET = {2: 1.10, 4: 1.10, 8: 1.25}
SIZE_CLASSES = ((4 << 20, "< 4 M weights"), (16 << 20, "4-16 M"), (64 << 20, "16-64 M"), (1 << 62, ">= 64 M"))
EPS = 1e-9

Key = tuple[str, int, int, int, str]  # (codebook, m, n, k, mode)


def size_class(n: int, k: int) -> str:
    return next(name for top, name in SIZE_CLASSES if n * k < top)


def launch(cid: str, m: int, k: int) -> dict[str, Any]:
    """A candidate's launch facts at (M, K): family, engine, identity S, geometry."""
    c = BY_ID[cid]
    return {"id": cid, "family": c.family, "engine": c.engine, "S": c.identity(k), "threads": c.threads,
            "cpt": c.cpt, "mma_tiles": c.mma_tiles, "staged": c.staged,
            "row_tile": mma_row_tiles(m) if c.mma_tiles else row_tile(m, c.cpt)}


def summary(ratios: list[float]) -> dict[str, Any]:
    return evaluate.summary(ratios)


def weighted_geomean(ratios: list[float], weights: list[float]) -> float:
    r, w = np.asarray(ratios), np.asarray(weights, dtype=np.float64)
    return 100 * (math.exp(float(np.sum(w * np.log(r)) / w.sum())) - 1)


def price(meas_times: Mapping[Key, Mapping[str, float]], chosen: Mapping[tuple[str, int, int], int],
          covered: Callable[[Key, str], bool] | None = None) -> dict[Key, float]:
    """Per cell: best launch of the kept identity / the cell's best. `covered(key, best_id)` marks cells where an
    added launch is assumed to give the kept identity at the cell's best time (ratio 1)."""
    out = {}
    for key, cell in sorted(meas_times.items()):
        cb, m, n, k, _ = key
        best_id = min(cell, key=lambda c: (cell[c], c))
        serve = serving(m, n, k)
        mine = [t for c, t in cell.items() if serve.get(c) == chosen[(cb, n, k)]]
        if not mine:
            continue
        out[key] = 1.0 if covered is not None and covered(key, best_id) else min(mine) / cell[best_id]
    return out


def aggregate(ratios: Mapping[Key, float], profile: Mapping[int, int], measured_ms: list[int]) -> dict[str, Any]:
    """geomean / p95 / max overall and per M; the profile-weighted geomean over the measured M values (their
    profile weights, renormalized)."""
    by_m: dict[int, list[float]] = {}
    for key, r in ratios.items():
        by_m.setdefault(key[1], []).append(r)
    keys = [key for key in ratios if key[1] in profile]
    return {"all": summary(list(ratios.values())), "m": {str(m): summary(v) for m, v in sorted(by_m.items())},
            "profile_measured_m": {
                "geomean": weighted_geomean([ratios[key] for key in keys], [profile[key[1]] for key in keys]),
                "weights": {str(m): profile[m] for m in measured_ms}, "n": len(keys)}}


def profile_price(cells: Mapping[Key, Mapping[str, float]], chosen: Mapping[tuple[str, int, int], int],
                  profile: Mapping[int, int], covered: Callable[[Key, str], bool] | None = None) -> dict[str, Any]:
    """evaluate._price over every scored cell (measured and model-filled), with `covered` cells at ratio 1."""
    ratios, weights, at_one = [], [], []
    for key, cell in sorted(cells.items()):
        cb, m, n, k, _ = key
        if m not in profile:
            continue
        best_id = min(cell, key=lambda c: (cell[c], c))
        serve = serving(m, n, k)
        mine = min(t for c, t in cell.items() if serve.get(c) == chosen[(cb, n, k)])
        r = 1.0 if covered is not None and covered(key, best_id) else mine / cell[best_id]
        ratios.append(r)
        weights.append(profile[m])
        if m == 1:
            at_one.append(r)
    return {"m1": summary(at_one), "profile": {"geomean": weighted_geomean(ratios, weights),
                                               "max": 100 * (max(ratios) - 1), "n": len(ratios)}}


# ---------------------------------------------------------------------------------------------------------
# Proposals: launches the registry lacks, as predicates on (M, kept S, fastest launch).


@dataclass(frozen=True)
class Proposal:
    name: str
    text: str
    test: Callable[[int, int, dict[str, Any]], bool]  # (m, kept S, fastest launch facts) -> covered
    ms: range = range(1, 33)  # the M values whose instantiations a new variant needs

    def covers(self, chosen: Mapping[tuple[str, int, int], int]) -> Callable[[Key, str], bool]:
        def cov(key: Key, best_id: str) -> bool:
            cb, m, n, k, _ = key
            return self.test(m, chosen[(cb, n, k)], launch(best_id, m, k))
        return cov


PROPOSALS = [
    Proposal("m1-lanes-to-chains-S>1",
             "M = 1, dp4a: a direct-style CTA whose G lanes per column (the fastest launch's split) decode blocks in "
             "parallel and hand each block's term, in block order, to S_kept < G chains (partials in shared memory, "
             "folded in order as direct does): the kept identity S >= 2 at the fastest launch's geometry",
             lambda m, s, b: m == 1 and b["engine"] == "dp4a" and 1 < s < b["S"], range(1, 2)),
    Proposal("m1-lanes-to-one-chain",
             "M = 1, dp4a: the same hand-off into one chain (S_kept = 1) at the fastest launch's split G "
             "(lab/experiments/lanes_variant.py and rowfold_variant.py are S = 1 prototypes of this)",
             lambda m, s, b: m == 1 and b["engine"] == "dp4a" and s == 1 < b["S"], range(1, 2)),
    Proposal("mma-kpar-partitions-per-cta",
             "M >= 4, tensor cores: kpar's grid of G CTAs along K producing S_kept = r·G partitions, r consecutive "
             "partitions per CTA, each folded into its own chain and written as its own partial (S_kept partials, "
             "folded as today)",
             lambda m, s, b: m > 1 and b["engine"] == "mma" and b["family"] == "kpar" and s > b["S"], range(2, 33)),
    Proposal("mma-wide-chains",
             "M >= 4, tensor cores: the wide ring (one CTA walks all of K) keeping S_kept > 1 chains, switching chain "
             "at each partition boundary and folding them in order at the end (no workspace)",
             lambda m, s, b: m > 1 and b["engine"] == "mma" and b["family"] == "wide" and s > 1, range(2, 33)),
    Proposal("mma-coarser",
             "tensor cores at a coarser identity than the grid split (S_kept < G): the G CTAs' block terms handed in "
             "block order to S_kept chains",
             lambda m, s, b: b["engine"] == "mma" and s < b["S"]),
    Proposal("dp4a-finer",
             "dp4a at a finer identity than the fastest launch's split (S_kept > G): S_kept/G partitions per lane",
             lambda m, s, b: b["engine"] == "dp4a" and s > b["S"]),
]


def refine(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sub-groups of the losing cells by (M, kept S, fastest launch's engine, family, S), largest loss first."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for c in cells:
        b = c["best"]
        g = groups.setdefault((c["m"], c["kept_S"], b["engine"], b["family"], b["S"]), {
            "m": c["m"], "kept_S": c["kept_S"], "best_engine": b["engine"], "best_family": b["family"],
            "best_S": b["S"], "cells": 0, "log_loss": 0.0, "codebooks": {}, "size_classes": {}, "best_ids": {}})
        g["cells"] += 1
        g["log_loss"] += c["log_loss"]
        for field, value in (("codebooks", c["codebook"]), ("size_classes", c["size_class"]),
                             ("best_ids", b["id"])):
            g[field][value] = g[field].get(value, 0) + 1
    return sorted(groups.values(), key=lambda g: -g["log_loss"])


def cover(hit: list[dict[str, Any]], total: float, part: float = 0.9) -> list[dict[str, Any]]:
    """The fewest (fastest launch, kept S) pairs, greedily, that carry `part` of the loss the cells `hit` carry:
    the concrete launches to add first."""
    pairs: dict[tuple[str, int], float] = {}
    for c in hit:
        pairs[(c["best"]["id"], c["kept_S"])] = pairs.get((c["best"]["id"], c["kept_S"]), 0.0) + c["log_loss"]
    want, got, out = part * math.fsum(pairs.values()), 0.0, []
    for (cid, s), v in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0])):
        if got >= want:
            break
        got += v
        out.append({"geometry": cid, "identity": s, "share_of_loss": v / total,
                    "cells": sum(c["best"]["id"] == cid and c["kept_S"] == s for c in hit)})
    return out


def kernels_added(base_ids: set[str], codebooks: list[str], ms: range) -> int:
    """Template instantiations of the base launches' kernels over the codebooks and every M tiling: what a new
    template variant of each (a second fold order) would add, an estimate of the compile cost."""
    return len({BY_ID[c].kernel_name(cb, m) for c in base_ids for cb in codebooks for m in ms})


def study(folder: Path, policy_path: Path | None, bench_path: Path | None, log: Callable[[str], None]) -> dict:
    start = time.monotonic()
    corpus = load(folder)
    meas = Measurements.from_corpus(corpus)
    profile = dict(DEFAULT_PROFILE)
    log(f"{folder.name}: {len(meas.times)} measured cells, {len(corpus.current)} current records "
        f"({time.monotonic() - start:.0f} s)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = TimeModel().fit(meas)
    scores = score(meas, model, profile)
    chosen = scores.chosen
    log(f"time model and identities as train makes them ({time.monotonic() - start:.0f} s)")
    measured_ms = sorted({key[1] for key in meas.times})
    present: dict[tuple[int, str], int] = {}
    for key in meas.times:
        present[(key[1], key[0])] = present.get((key[1], key[0]), 0) + 1

    out: dict[str, Any] = {
        "corpus": dict(meas.source) | {"cells": len(meas.times), "records": len(corpus.current),
                                       "measured_m": measured_ms, "modes": list(meas.modes),
                                       "cells_per_m_codebook": {f"{m}:{cb}": v
                                                                for (m, cb), v in sorted(present.items())},
                                       "noise_rel": meas.noise_rel},
        "registry": {"candidates": len(CANDIDATES), "instantiations": len(instantiations())},
    }

    # 1. the price of invariance
    ratios = price(meas.times, chosen)
    out["price"] = aggregate(ratios, profile, measured_ms) | {
        "train_profile": evaluate._price(scores, profile),
        "codebook": {cb: summary([r for key, r in ratios.items() if key[0] == cb]) for cb in meas.codebooks}}
    if policy_path is not None:
        table = load_policy(policy_path)
        kept = {geo: table.identity(*geo)[0] for geo in meas.geometries()}
        out["price_table_identities"] = aggregate(price(meas.times, kept), profile, measured_ms) | {
            "policy": str(policy_path.name), "identities_differ_from_train": sum(kept[g] != chosen[g] for g in kept),
            "shapes": len(kept)}

    # 2. where it comes from
    cells = []
    for key, r in ratios.items():
        if r <= 1.0 + EPS:
            continue
        cb, m, n, k, mode = key
        cell = meas.times[key]
        best_id = min(cell, key=lambda c: (cell[c], c))
        kept_id = best_launch(cell, chosen[(cb, n, k)], m, n, k, 0.0)
        cells.append({"codebook": cb, "m": m, "n": n, "k": k, "mode": mode, "size_class": size_class(n, k),
                      "kept_S": chosen[(cb, n, k)], "kept": launch(kept_id, m, k) | {"us": cell[kept_id]},
                      "best": launch(best_id, m, k) | {"us": cell[best_id]}, "loss_pct": 100 * (r - 1),
                      "log_loss": math.log(r)})
    total = math.fsum(math.log(r) for r in ratios.values())
    groups = refine(cells)
    for g in groups:
        g["share"] = g["log_loss"] / total
        g["geomean_pct"] = 100 * (math.exp(g["log_loss"] / g["cells"]) - 1)
    by_m_share = {}
    for m in measured_ms:
        by_m_share[str(m)] = math.fsum(c["log_loss"] for c in cells if c["m"] == m) / total
    out["loss"] = {"total_log_loss": total, "cells": len(ratios), "losing_cells": len(cells),
                   "losing_beyond_noise": sum(c["loss_pct"] > 100 * meas.noise_rel for c in cells),
                   "share_by_m": by_m_share, "groups": groups,
                   "cells_detail": sorted(cells, key=lambda c: -c["log_loss"])}

    # 3. proposals, alone and cumulative (in order of gain alone)
    alone = []
    for p in PROPOSALS:
        cov = p.covers(chosen)
        hit = [c for c in cells if p.test(c["m"], c["kept_S"], c["best"])]
        new_ids = {(c["best"]["id"], c["kept_S"]) for c in hit}
        base = {c["best"]["id"] for c in hit}
        codebooks = sorted({c["codebook"] for c in hit})
        gain_by: dict[str, dict[str, float]] = {"codebook": {}, "size_class": {}, "m": {}}
        for c in hit:
            for field, value in (("codebook", c["codebook"]), ("size_class", c["size_class"]), ("m", str(c["m"]))):
                gain_by[field][value] = gain_by[field].get(value, 0.0) + c["log_loss"] / total
        alone.append({"name": p.name, "text": p.text, "cells": len(hit),
                      "share_of_loss": math.fsum(c["log_loss"] for c in hit) / total,
                      "share_by": {f: dict(sorted(v.items(), key=lambda kv: -kv[1])) for f, v in gain_by.items()},
                      "new_launches": len(new_ids), "first_launches_90pct": len(cover(hit, total)),
                      "first_launches": cover(hit, total),
                      "instantiations_estimate": kernels_added(base, codebooks, p.ms) if base else 0,
                      "price_after_alone": aggregate(price(meas.times, chosen, cov), profile, measured_ms),
                      "train_profile_after_alone": profile_price(scores.cells, chosen, profile, cov)})
    order = sorted(alone, key=lambda a: -a["share_of_loss"])
    cumulative, added = [], []
    for a in order:
        added.append(next(p for p in PROPOSALS if p.name == a["name"]))

        def cov(key: Key, best_id: str, ps: tuple[Proposal, ...] = tuple(added)) -> bool:
            return any(p.covers(chosen)(key, best_id) for p in ps)
        cumulative.append({"added": [p.name for p in added],
                           "price": aggregate(price(meas.times, chosen, cov), profile, measured_ms),
                           "train_profile": profile_price(scores.cells, chosen, profile, cov)})
    out["proposals"] = {"assumption": "a new launch of the kept identity at the time of the cell's fastest existing "
                                      "launch, identities kept: prices after are lower bounds, gains upper bounds",
                        "alone": order, "cumulative": cumulative}

    # 4. small M on the big anchors
    big = [(n, k) for n, k in ANCHORS if n * k * 18 / 32 >= BIG_BYTES]
    rows = []
    for cb in sorted(SMALL_M):
        for n, k in big:
            one = meas.times.get((cb, 1, n, k, "graph"))
            if one is None:
                rows.append({"codebook": cb, "n": n, "k": k, "source": "corpus", "missing": "M=1 cell"})
                continue
            t1, b1 = min((t, c) for c, t in one.items())
            for m in (2, 4, 8):
                cell = meas.times.get((cb, m, n, k, "graph"))
                row = {"codebook": cb, "n": n, "k": k, "m": m, "source": "corpus", "m1_us": t1, "m1_best": b1}
                if cell is None:
                    rows.append(row | {"missing": f"no M={m} cell in the corpus"})
                    continue
                t, b = min((t, c) for c, t in cell.items())
                kept_t = min(t for c, t in cell.items() if serving(m, n, k).get(c) == chosen[(cb, n, k)])
                kept_t1 = min(t for c, t in one.items() if serving(1, n, k).get(c) == chosen[(cb, n, k)])
                rows.append(row | {"us": t, "best": b, "family": BY_ID[b].family, "engine": BY_ID[b].engine,
                                   "ratio": t / t1, "target": SMALL_M_TARGET[m], "met": t / t1 <= SMALL_M_TARGET[m],
                                   "table_ratio": kept_t / kept_t1})
    if bench_path is not None:
        bench = json.loads(bench_path.read_text())
        by = {(r["codebook"].lower(), r["m"], r["n"], r["k"]): r for r in bench["rows"]}
        for cb in sorted(SMALL_M):
            for n, k in big:
                one = by.get((cb, 1, n, k))
                for m in (2, 4, 8):
                    r = by.get((cb, m, n, k))
                    row = {"codebook": cb, "n": n, "k": k, "m": m, "source": bench_path.name}
                    if one is None or r is None:
                        rows.append(row | {"missing": f"no M={m if r is None else 1} row in the benchmark run"})
                        continue
                    rows.append(row | {"us": r["us"], "best": r["best"], "family": BY_ID[r["best"]].family,
                                       "engine": BY_ID[r["best"]].engine, "m1_us": one["us"], "m1_best": one["best"],
                                       "ratio": r["us"] / one["us"], "target": SMALL_M_TARGET[m],
                                       "met": r["us"] / one["us"] <= SMALL_M_TARGET[m]})
    out["small_m"] = {"anchors": big, "rows": rows}
    out["seconds"] = time.monotonic() - start
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", type=Path, help="corpus folder (one GPU model)")
    ap.add_argument("--policy", type=Path, help="also price this committed table's identities")
    ap.add_argument("--bench", type=Path, help="a bench/kernels.py result of the same GPU model (M = 2, 8)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    out = study(args.corpus, args.policy, args.bench, log)
    report(out, log)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


def _fmt(s: Mapping[str, Any]) -> str:
    return f"{s['geomean']:.2f} / {s['p95']:.2f} / {s['max']:.2f} % (n {s['n']})"


def report(out: Mapping[str, Any], log: Callable[[str], None]) -> None:
    p = out["price"]
    tp = p["train_profile"]
    log(f"registry: {out['registry']['candidates']} candidates, {out['registry']['instantiations']} instantiations")
    log(f"price (geomean / p95 / max): all {_fmt(p['all'])}; " + "; ".join(
        f"M={m} {_fmt(s)}" for m, s in p["m"].items()))
    log(f"  profile over measured M {p['profile_measured_m']['geomean']:.2f} %; train's: over the profile "
        f"{tp['profile']['geomean']:.2f} % (max {tp['profile']['max']:.2f}), M=1 {_fmt(tp['m1'])}")
    if "price_table_identities" in out:
        t = out["price_table_identities"]
        log(f"  table identities: all {_fmt(t['all'])} ({t['identities_differ_from_train']} of {t['shapes']} "
            "shapes differ from train's)")
    loss = out["loss"]
    log(f"losing cells {loss['losing_cells']} of {loss['cells']} ({loss['losing_beyond_noise']} beyond the noise "
        "band); share of the loss by M: " + ", ".join(f"M={m} {100 * v:.1f} %" for m, v in
                                                       loss["share_by_m"].items()))
    for g in loss["groups"][:15]:
        log(f"  M={g['m']:<2} kept S={g['kept_S']:<2} best {g['best_engine']:<4} {g['best_family']:<6} "
            f"S={g['best_S']:<2} cells {g['cells']:>4} share {100 * g['share']:5.1f} % geomean "
            f"{g['geomean_pct']:5.1f} %  top {max(g['best_ids'], key=g['best_ids'].get)}")
    for a, c in zip(out["proposals"]["alone"], out["proposals"]["cumulative"], strict=True):
        log(f"proposal {a['name']}: {a['cells']} cells, {100 * a['share_of_loss']:.1f} % of the loss, "
            f"{a['new_launches']} launches ({a['first_launches_90pct']} carry 90 %; "
            f"~{a['instantiations_estimate']} instantiations); alone -> all "
            f"{a['price_after_alone']['all']['geomean']:.2f} %, "
            f"M=1 {a['train_profile_after_alone']['m1']['geomean']:.2f} %, "
            f"profile {a['train_profile_after_alone']['profile']['geomean']:.2f} %; cumulative -> all "
            f"{c['price']['all']['geomean']:.2f} %, profile {c['train_profile']['profile']['geomean']:.2f} %, "
            f"M=1 {c['train_profile']['m1']['geomean']:.2f} %")
        log("    first: " + ", ".join(f"{f['geometry']} -> S={f['identity']} ({100 * f['share_of_loss']:.1f} %)"
                                      for f in a["first_launches"][:8]))
    for r in out["small_m"]["rows"]:
        if "missing" in r:
            continue
        log(f"  small M {r['source']:<24} {r['codebook']} {r['n']}x{r['k']} M={r['m']}: {r['ratio']:.2f}x "
            f"({'met' if r['met'] else 'missed'} {r['target']}) best {r['best']}")
    log(f"done in {out['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
