"""pays-study (issue 36): the commit every result row records, the map's arithmetic, and a tiny run of
all four parts whose tables are rebuilt from its CSVs."""

import csv
import re
import subprocess
from pathlib import Path

import pytest

from unbubble.experiments.pays import map_rows, pays_study
from unbubble.experiments.study_specs import PAYS_PARTS
from unbubble.experiments.sweep import source_commit


def test_source_commit_names_the_checkouts_head():
    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert re.fullmatch(re.escape(head) + r"(\+dirty)?", source_commit())


def test_the_map_divides_the_simulated_throughput_by_the_measured_overhead():
    from unbubble.experiments.overhead import break_even_barrier_rows

    measured = [{"N": 8, "a = m": 4, "model": "deep-cpu", "method": "paci a=4 + muon + error feedback @4×",
                 "token overhead ÷ flush": "1.25 ± 0.02"}]
    facts = {"paci a=4 + muon + error feedback @4×": {"overhead": 1.25, "relation": "="}}
    grid = map_rows(measured, facts)
    assert len(grid) == 8 and {(r["N"], r["m = a"]) for r in grid} == {(n, m) for n in (8, 16) for m in (1, 2, 4, 8)}
    sim = next(r for r in break_even_barrier_rows((8, 16), (1, 2, 4, 8)) if r["setup"].startswith("gpt2")
               and r["N"] == 8 and r["m"] == 4)
    cell = next(r for r in grid if r["cell"] == "measured")
    assert (cell["N"], cell["m = a"]) == (8, 4)
    assert cell["time-to-target ÷ fastest sync"] == f"{float(sim['none'].split()[0]) / 1.25:.2f}"
    assert cell["with clip"] == f"{float(sim['stale vs sync'].split()[0]) / 1.25:.2f}"
    other = next(r for r in grid if (r["N"], r["m = a"]) == (16, 2))
    assert other["cell"] == "simulated" and other["time-to-target ÷ fastest sync"].startswith("≥ 1 while overhead <")
    facts["paci a=4 + muon + error feedback @4×"]["relation"] = ">"  # not reached within the budgets: a bound
    assert map_rows(measured, facts)[2]["time-to-target ÷ fastest sync"].startswith("< ")
    # PACI's own run reached the twin's loss (overhead ≤ 1): the speed-up is at least the ratio (was printed
    # as exactly it)
    facts["paci a=4 + muon + error feedback @4×"].update(overhead=1.0, relation="≤")
    assert map_rows(measured, facts)[2]["time-to-target ÷ fastest sync"] == f"≥ {float(sim['none'].split()[0]):.2f}"


def test_tiny_study_trains_every_part_records_commits_and_rebuilds_from_its_csvs(tmp_path):
    out = tmp_path / "pays"
    result = pays_study(out, size="tiny", workers=1)
    head = source_commit()
    for part in PAYS_PARTS:
        runs = list(csv.DictReader(open(out / part / "runs.csv")))
        assert runs and all(r["commit"] == head for r in runs), part
    table = list(csv.DictReader(open(out / "pays_study.csv")))
    assert {r["part"] for r in table} == set(PAYS_PARTS)
    assert "Re-run of a published row at commit" in result.markdown
    again = pays_study(tmp_path / "again", size="tiny", analyze=out)
    assert again.markdown.split("Command:")[0] == result.markdown.split("Command:")[0]
