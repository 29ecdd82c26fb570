"""The committed kernel benchmark report (bench/results/kernels-nvidia-h200.md) is what bench/kernels_report.py
renders from the committed JSON of the same run, so its figures and target verdicts cannot drift from the
measurements. Also tools/ncu_summary.py on recorded Nsight Compute logs (tests/data/)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = "bench/results/kernels-nvidia-h200.json"
DATA = REPO / "tests" / "data"  # recorded runs of the tools (A/B runs, ncu logs), the tools' test inputs


def repo_script(path: str):
    """A script of the checkout (bench/ or tools/: scripts, not a package), loaded from its file: "tools/ab_decide"."""
    file = REPO / f"{path}.py"
    if not file.is_file():
        pytest.skip(f"{file.parent.name}/ is not part of this tree (an installed package without the checkout)")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module  # before it runs: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def bench_script(name: str):
    """A module of bench/, loaded from its file."""
    return repo_script(f"bench/{name}")


@pytest.fixture(scope="module")
def report():
    return bench_script("kernels_report").report


def test_committed_report_is_rendered_from_the_committed_json(report):
    data = json.loads((REPO / RESULTS).read_text())
    assert report(data, RESULTS) == (REPO / RESULTS).with_suffix(".md").read_text()


def test_a_changed_measurement_changes_the_report(report):
    """Negative control: doubling one row's time is visible in the rendered report."""
    data = json.loads((REPO / RESULTS).read_text())
    changed = copy.deepcopy(data)
    changed["rows"][0]["us"] *= 2
    assert report(changed, RESULTS) != report(data, RESULTS)


def test_floors_of_the_run_are_reported(report):
    """A run that measured the floors (bench/kernels.py's time_floors) shows them, and each small shape's time above
    the one-cold-word floor; a run without them (an older JSON) renders without."""
    data = json.loads((REPO / RESULTS).read_text())
    with_floors = copy.deepcopy(data)
    with_floors["floor_us"] = {"empty": 0.61, "cold_word": 1.37}
    text = report(with_floors, RESULTS)
    assert "an empty launch 0.61 µs" in text and "one cold word 1.37 µs" in text
    small = next(r for r in data["rows"] if r["codebook"] == "Q4_0" and r["m"] == 1 and r["n"] == 512)
    assert f"+{small['us'] - 1.37:.2f})" in text
    without = {key: value for key, value in data.items() if key != "floor_us"}
    assert "floor" not in report(without, RESULTS).lower()


def test_streaming_reads_of_the_run_are_reported(report):
    """A run that timed a streaming read of each shape's bytes (bench/kernels.py's stream_floor) shows it as `strm%`
    and beside each small shape; a run with one row missing it renders without the column."""
    data = json.loads((REPO / RESULTS).read_text())
    streamed = copy.deepcopy(data)
    for row in streamed["rows"]:
        row["stream_us"] = row["us"] / 4
    text = report(streamed, RESULTS)
    assert "strm%" in text and f"{25.0:6.1f}" in text
    small = next(r for r in data["rows"] if r["codebook"] == "Q4_0" and r["m"] == 1 and r["n"] == 512)
    assert f" / {small['us'] / 4:.2f} µs" in text
    del streamed["rows"][-1]["stream_us"]
    assert "strm%" not in report(streamed, RESULTS)


# The cells of tests/data/ncu-v16-h200.log, in the order tools/profile_candidates.py ran them (lab/journal.md).
NCU_CELLS = ["Q4_0:1:4096:4096:direct.s16.t8.c1", "Q4_0:1:1024:4096:direct.s32.t16.c1",
             "Q4_0:1:14336:4096:kpar.s8.t64.c2", "Q4_0:1:27648:5120:kpar.s4.t64.c2",
             "IQ4_NL:1:27648:5120:kpar.s8.t64.c2",
             "IQ4_XS:1:27648:5120:direct.s4.t32.c1", "Q4_K:1:27648:5120:direct.s4.t32.c1",
             "Q4_0:8:27648:5120:kpar.s4.t128.mma2", "Q4_0:16:14336:4096:wide.s1.t128.mma2",
             "Q4_0:16:151936:4096:wide.s1.t128.mma4", "Q8_0:16:14336:4096:kpar.s4.t128.mma2"]


def test_end_to_end_target_is_q4_0s_and_other_codebooks_show_their_byte_bound():
    """2.5x cuBLAS fp16 is Q4_0's target: Q8_0's 34 bytes per 32 weights cap it at 2 / (34 / 32) = 1.88x, shown beside
    its ratio. Negative control: Q4_0's ratio moved below 2.5x flips the verdict."""
    targets = bench_script("kernels_report").targets
    data = json.loads((REPO / RESULTS).read_text())
    (label, measured, met), = [t for t in targets(data) if t[0].startswith("end-to-end decode, M = 1")]
    q4 = data["end_to_end_us"]["Q4_0 M=1"]
    assert met == (q4["cublas_fp16"] / q4["ours"] >= 2.5)
    assert "Q8_0" in measured and "(≤ 1.88×)" in measured
    slower = copy.deepcopy(data)
    slower["end_to_end_us"]["Q4_0 M=1"]["ours"] = q4["cublas_fp16"] / 2.4
    assert [t[2] for t in targets(slower) if t[0] == label] == [False]


def test_ncu_summary_of_the_committed_log():
    """tools/ncu_summary.py gives the notes' ncu table from the committed log; cells in another order are refused
    (each cell's grid is checked against the kernels the log holds)."""
    summary = repo_script("tools/ncu_summary").summary
    text = (DATA / "ncu-v16-h200.log").read_text()
    lines = summary(text, NCU_CELLS)
    assert len(lines) == len(NCU_CELLS)
    assert lines[0].startswith(NCU_CELLS[0]) and "   5.95 µs" in lines[0]
    assert "grid   512  waves 0.78   93 regs" in lines[0]
    assert "grid   224  waves 0.42" in lines[8]
    with pytest.raises(SystemExit, match="did not run its grid"):
        summary(text, NCU_CELLS[1:] + NCU_CELLS[:1])


# The cells of the streaming comparison (lab/journal.md, version 19): our best M = 1 launches and the streaming read.
NCU_M1_CELLS = ["Q4_0:1:151936:4096:kpar.s2.t128.c1", "Q4_0:1:27648:5120:kpar.s4.t64.c2",
                "Q4_0:1:14336:4096:kpar.s8.t64.c2", "Q4_0:1:4096:4096:direct.s16.t16.c1",
                "Q8_0:1:27648:5120:direct.s2.t64.c1"]
NCU_STREAM_CELLS = ["stream:350060544:528", "stream:350060544:42737", "stream:79626240:528", "stream:79626240:2430",
                    "stream:33030144:528", "stream:33030144:1008", "stream:9437184:528", "stream:9437184:288",
                    "stream:150405120:528"]


def test_ncu_summary_of_the_metric_logs():
    """The notes' streaming comparison comes from the committed --metrics logs (DRAM bytes, active warps), streaming
    reads named by their grid; a cell list in another order is refused there too."""
    summary = repo_script("tools/ncu_summary").summary
    ours = summary((DATA / "ncu-v16-m1-metrics-h200.log").read_text(), NCU_M1_CELLS)
    assert "  88.29 µs  DRAM  350.7 MB 83.4 %" in ours[0] and "warps 19.5 %" in ours[1]
    log = (DATA / "ncu-stream-metrics-h200.log").read_text()
    reads = summary(log, NCU_STREAM_CELLS)
    assert "  79.68 µs  DRAM  350.1 MB 92.0 %" in reads[0] and "warps 97.4 %" in reads[0]
    with pytest.raises(SystemExit, match="did not run its grid"):
        summary(log, NCU_STREAM_CELLS[::-1])
