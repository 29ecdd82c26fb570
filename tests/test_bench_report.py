"""The committed kernel benchmark report (bench/results/kernels-h200.md) is what bench/kernels_report.py renders from
the committed JSON of the same run, so its figures and target verdicts cannot drift from the measurements."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = "bench/results/kernels-h200.json"


@pytest.fixture(scope="module")
def report():
    """bench/kernels_report.py's report function (bench/ is scripts, not a package)."""
    path = REPO / "bench" / "kernels_report.py"
    if not path.is_file():
        pytest.skip("bench/ is not part of this tree (an installed package without the checkout)")
    spec = importlib.util.spec_from_file_location("kernels_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.report


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
