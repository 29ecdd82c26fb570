"""README.md's figures block is what bench/readme_figures.py renders from the committed results (the kernel
benchmark in bench/results/, the committed corpus and the committed table's policy), so the README's figures
cannot drift from them."""

from __future__ import annotations

import copy
import json

import pytest
from test_bench_report import REPO, bench_script

KERNELS = REPO / "bench" / "results" / "kernels-nvidia-h200.json"


@pytest.fixture(scope="module")
def figures():
    return bench_script("readme_figures")


def test_the_readme_holds_the_rendered_figures(figures):
    text = (REPO / "README.md").read_text()
    block = figures.render()
    assert "### NVIDIA H200" in block and "the committed table (policy with overlays) | 3.90 %" in block
    assert figures.replace_block(text, block) == text


def test_a_changed_measurement_changes_the_block(figures, tmp_path, monkeypatch, capsys):
    """Negative control: one kernel time doubled shows in the rendered table, and --check refuses a README whose
    block is not the rendered one (and accepts it once rewritten)."""
    data = json.loads(KERNELS.read_text())
    changed = copy.deepcopy(data)
    row = next(r for r in changed["rows"] if (r["codebook"], r["m"], r["n"], r["k"]) == ("Q4_0", 1, 4096, 4096))
    row["us"] *= 2
    source = str(KERNELS.relative_to(REPO))
    assert figures.kernel_table(changed, source) != figures.kernel_table(data, source)
    monkeypatch.setattr(figures, "render", lambda: "new figures\n")
    stale = tmp_path / "README.md"
    stale.write_text(figures.replace_block((REPO / "README.md").read_text(), "old figures\n"))
    assert figures.main(["--check", "--readme", str(stale)]) == 1
    assert "not what the committed results give" in capsys.readouterr().err
    assert figures.main(["--readme", str(stale)]) == 0 and figures.main(["--check", "--readme", str(stale)]) == 0
    assert "new figures" in stale.read_text() and "old figures" not in stale.read_text()


def test_the_block_needs_both_markers_once(figures):
    with pytest.raises(SystemExit, match="must hold"):
        figures.replace_block("no markers here\n", "x\n")
    with pytest.raises(SystemExit, match="must hold"):
        figures.replace_block(f"{figures.END}\n{figures.BEGIN}\n", "x\n")
