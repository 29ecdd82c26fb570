"""tools/ab_decide.py, the verdict a device call takes between an A/B of kernel sources and the sweep, on recorded
A/B runs (tests/data/): version 35 against 34 is kept, version 33 against 32 is not (one cell 6.6 % slower)."""

from __future__ import annotations

import json

import pytest
from test_bench_report import DATA, bench_script, repo_script


@pytest.fixture(scope="module")
def ab():
    return repo_script("tools/ab_decide")


def runs(*names: str) -> list[dict]:
    return [json.loads((DATA / f"ab-{name}-h200.json").read_text()) for name in names]


def test_a_faster_source_is_kept(ab, capsys):
    verdict = ab.decide(runs("v35-direct", "v35-kpar", "v35-wide"), 1.03)
    assert verdict.keep_tree and verdict.geomean < 0.98 and len(verdict.ratios) == 18  # 2 codebooks x 9 anchors
    # The best over the families: on IQ4_NL 151936x4096 the baseline's is a kpar launch (106.1 us), the tree's a
    # direct one (100.1 us), where direct alone gives 0.936.
    assert verdict.ratios[("IQ4_NL", 1, 151936, 4096)] == pytest.approx(100.1 / 106.1, abs=2e-3)
    assert ab.main([str(DATA / f"ab-v35-{f}-h200.json") for f in ("direct", "kpar", "wide")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("keep the tree's source")


def test_a_gain_below_the_asked_geomean_keeps_the_baseline(ab):
    files = [str(DATA / f"ab-v35-{f}-h200.json") for f in ("direct", "kpar", "wide")]
    geomean = ab.decide(runs("v35-direct", "v35-kpar", "v35-wide"), 1.03).geomean
    assert ab.main([*files, "--geomean", f"{geomean + 0.002:.3f}"]) == 0
    assert ab.main([*files, "--geomean", f"{geomean - 0.002:.3f}"]) == 1


def test_one_slow_cell_keeps_the_baseline(ab):
    verdict = ab.decide(runs("v33-direct"), 1.03)
    assert not verdict.keep_tree and verdict.worst == pytest.approx(1.066, abs=1e-3)
    assert ab.decide(runs("v33-direct"), 1.07).keep_tree is (verdict.geomean < 1.0)
    assert ab.main([str(DATA / "ab-v33-direct-h200.json")]) == 1


def test_a_launch_the_baseline_lacks_counts_for_the_tree_only(ab):
    cell = {"codebook": "Q4_0", "m": 8, "n": 4096, "k": 4096}
    run = {"sources": ["base34.cu"], "rows": [{**cell, "candidate": "a", "us": {"base34": 10.0, "tree": 10.0}},
                                              {**cell, "candidate": "a.p4", "us": {"tree": 8.0}}]}
    assert ab.decide([run], 1.03).ratios == {("Q4_0", 8, 4096, 4096): 0.8}


def test_runs_of_different_baselines_are_refused(ab, capsys):
    with pytest.raises(ValueError, match="different baselines"):
        ab.decide(runs("v33-direct", "v35-direct"), 1.03)
    assert ab.main([str(DATA / "ab-v33-direct-h200.json"), str(DATA / "ab-v35-kpar-h200.json")]) == 2
    assert capsys.readouterr().err.startswith("error: the runs name different baselines")


def requesting(run: dict, family: str, codebooks: str, ms: str) -> dict:
    """A committed run with the `requested` cells source_ab now records, as its command asked for them."""
    anchors = bench_script("anchors").ANCHORS
    cells = [[cb, int(m), n, k] for cb in codebooks.split(",") for m in ms.split(",") for n, k in anchors]
    return run | {"requested": {"family": family, "cells": cells}}


def test_a_cut_run_cannot_keep_the_tree(ab, tmp_path, capsys):
    # Versions 38-44's direct run measured both codebooks it was asked for: the tree is kept.
    done = requesting(runs("v38-44-direct")[0], "direct", "IQ4_XS,Q6_K", "1")
    assert ab.decide([done], 1.03).unmeasured == () and ab.decide([done], 1.03).exit_code == 0
    # Negative control: the same run asked for a third codebook it never reached gives no verdict, naming it.
    cut = requesting(runs("v38-44-direct")[0], "direct", "IQ4_XS,Q6_K,IQ4_NL", "1")
    verdict = ab.decide([cut], 1.03)
    assert verdict.keep_tree and verdict.exit_code == 2 and verdict.unmeasured == (("direct", "IQ4_NL", 1),)
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    assert ab.main([str(tmp_path / "cut.json")]) == 2
    out = capsys.readouterr().out.splitlines()
    assert "not measured (the run was cut): direct IQ4_NL M=1" in out and out[-1].endswith("were not measured")


def test_a_cut_run_with_a_slow_cell_keeps_the_baseline(ab):
    # Versions 38-45's direct run was cut after IQ4_XS and Q4_K of the five codebooks asked for; its measured
    # IQ4_XS 512x2048 (1.083) is evidence enough to keep the baseline.
    cut = requesting(runs("v38-45-direct")[0], "direct", "IQ4_XS,Q4_K,IQ4_NL,Q5_K,Q6_K", "1")
    verdict = ab.decide([cut], 1.03)
    assert verdict.unmeasured == (("direct", "IQ4_NL", 1), ("direct", "Q5_K", 1), ("direct", "Q6_K", 1))
    assert verdict.exit_code == 1 and not verdict.keep_tree and verdict.worst == pytest.approx(1.083, abs=2e-3)
