"""pays-study (issue 36): the commit every result row records, the map's arithmetic worked by hand, a tiny
run of all four parts, and the published tables rebuilt from their CSVs."""

import csv
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from unbubble.experiments.pays import OWN, map_rows, pays_study, switch_rows
from unbubble.experiments.study_specs import PAYS_PARTS
from unbubble.experiments.sweep import source_commit

from helpers import unpublished_rows


def test_source_commit_names_the_checkouts_head():
    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert re.fullmatch(re.escape(head) + r"(\+dirty)?", source_commit())


def test_the_map_cell_of_1f1b_on_unit_costs_is_the_bubble_formula():
    """On unit costs (F = 1, B = 2) 1F1B-flush's step is (m + N − 1)(F + B) and PACI's steady update
    m(F + B) (no bubble): at N = 8, m = 4 the ratio is (4 + 7) / 4 = 2.75."""
    from unbubble.experiments.overhead import break_even_barrier_rows

    row = next(r for r in break_even_barrier_rows((8,), (4,), ("1f1b-flush",)) if r["setup"].startswith("unit"))
    assert row["none"] == "2.75 (1f1b-flush)"


def test_the_map_divides_the_simulated_throughput_by_the_measured_overhead(monkeypatch):
    """The simulated cells are given (throughput ratio 2.75 without a barrier, 2.60 with the clip at
    N = 8, m = 4; 1.50 and 1.40 elsewhere); the measured cell is worked by hand: seeds' overheads 1.2 and
    1.3 give 2.75 / 1.2 = 2.2917 and 2.75 / 1.3 = 2.1154, mean 2.2035, std |2.2917 − 2.1154| / √2 = 0.1247;
    with the clip 2.6 / 1.2 = 2.1667 and 2.6 / 1.3 = 2.0, mean 2.0833, std 0.1179."""
    from unbubble.experiments import overhead

    def given(ns, ms):
        assert (tuple(ns), tuple(ms)) == ((8, 16), (1, 2, 4, 8))
        cells = [{"setup": setup, "N": n, "m": m, "none": "1.50 (zb-h2)", "stale vs sync": "1.40 (zb-h2)"}
                 for setup in ("unit costs (F = 1, B = 2)", "gpt2-medium, H200") for n in ns for m in ms]
        for c in cells:
            if c["setup"].startswith("gpt2") and (c["N"], c["m"]) == (8, 4):
                c.update({"none": "2.75 (1f1b-flush)", "stale vs sync": "2.60 (1f1b-flush)"})
        return cells

    monkeypatch.setattr(overhead, "break_even_barrier_rows", given)
    label = "paci a=4 + muon + error feedback @4×"
    measured = [{"N": 8, "a = m": 4, "model": "deep-cpu", "method": label, "token overhead ÷ flush": "1.25 ± 0.02"}]
    facts = {label: {"overhead": 1.25, "relation": "=", "per_seed": [(1.2, "="), (1.3, "=")]}}
    grid = map_rows(measured, facts)
    assert len(grid) == 8 and {(r["N"], r["m = a"]) for r in grid} == {(n, m) for n in (8, 16) for m in (1, 2, 4, 8)}
    cell = next(r for r in grid if r["cell"] == "measured")
    assert (cell["N"], cell["m = a"], cell["model, horizon"]) == (8, 4, "deep-cpu, 4×")
    assert cell["throughput ÷ fastest sync"] == "2.75 (1f1b-flush)"
    # paired: the ratio per seed, then mean ± std (was: the throughput over the mean overhead, 2.75 / 1.25 = 2.20)
    assert cell["time-to-target ÷ fastest sync"] == "2.20 ± 0.12"
    assert cell["with clip"] == "2.08 ± 0.12"
    other = next(r for r in grid if (r["N"], r["m = a"]) == (16, 2))
    assert other["cell"] == "simulated" and other["time-to-target ÷ fastest sync"] == "≥ 1 while overhead < 1.50"
    assert other["with clip"] == "≥ 1 while overhead < 1.40"
    # seed 1 not reached within the budgets: its overhead (1.5) is a lower bound, its ratio 2.75 / 1.5 = 1.83
    # an upper one; seeds in order
    facts[label].update(relation=">", per_seed=[(1.2, "="), (1.5, ">")])
    assert map_rows(measured, facts)[2]["time-to-target ÷ fastest sync"] == "2.29, ≤ 1.83"
    # PACI's own run reached the twin's loss (overhead ≤ 1): the speed-up is at least the ratio
    facts[label].update(overhead=1.0, relation="≤", per_seed=[(1.0, "≤")])
    assert map_rows(measured, facts)[2]["time-to-target ÷ fastest sync"] == "≥ 2.75"


def test_a_switched_runs_simulated_time_mixes_flushs_and_pacis_throughput_by_its_share(monkeypatch):
    """Given PACI at 1.50× the fastest synchronous schedule's throughput and 2.50× 1F1B-flush's, flush
    runs at 1.50 / 2.50 = 0.60 of the fastest. A run with K = 10 % of its tokens on flush has the
    throughput 1 / (0.1 / 0.6 + 0.9 / 1.5) = 1 / 0.76667 = 1.3043; its seeds' overheads 1.1 and 1.2 give
    1.3043 / 1.1 = 1.1858 and 1.3043 / 1.2 = 1.0870, mean 1.1364, std 0.0988 / √2 = 0.0699. K = 0 is PACI:
    1.50, and a seed above the largest budget (> 1.5) bounds its ratio from above (≤ 1.00)."""
    from unbubble.experiments import overhead

    def given(ns, ms, schedules=overhead.SYNCHRONOUS):
        assert (tuple(ns), tuple(ms)) == ((8,), (4,))
        ratio = "2.50 (1f1b-flush)" if tuple(schedules) == ("1f1b-flush",) else "1.50 (zb-h2)"
        return [{"setup": "unit costs (F = 1, B = 2)", "N": 8, "m": 4, "none": "9.99 (x)"},
                {"setup": "gpt2-medium, H200", "N": 8, "m": 4, "none": ratio}]

    monkeypatch.setattr(overhead, "break_even_barrier_rows", given)
    paci, switched = "paci a=4 @1×", "flush 10% → paci a=4 @1×"
    spec = {"methods": [{"label": "flush @1×"}, {"label": paci, "baseline": "flush @1×"},
                        {"label": switched, "baseline": "flush @1×", "switch_at": 0.1}]}
    measured = [{"N": 8, "a = m": 4, "method": label, "token overhead ÷ flush": "o", "per seed (paired)": "s",
                 "vs fastest synchronous": "c"} for label in (switched, paci, "other @1×")]
    facts = {switched: {"per_seed": [(1.1, "="), (1.2, "=")]}, paci: {"per_seed": [(1.3, "="), (1.5, ">")]}}
    rows = switch_rows(measured, facts, spec)
    assert [(r["horizon"], r["flush share K"]) for r in rows] == [("1×", "0%"), ("1×", "10%")]
    assert rows[1]["throughput ÷ fastest sync (gpt2-medium, simulated)"] == "1.30"
    assert rows[1]["time-to-target ÷ fastest sync (gpt2-medium)"] == "1.14 ± 0.07"
    assert rows[1]["time-to-target ÷ fastest sync (study's clock)"] == "c"
    assert rows[0]["throughput ÷ fastest sync (gpt2-medium, simulated)"] == "1.50"
    assert rows[0]["time-to-target ÷ fastest sync (gpt2-medium)"] == "1.15, ≤ 1.00"


def test_tiny_study_trains_every_part_records_commits_and_rebuilds_from_its_csvs(tmp_path):
    out = tmp_path / "pays"
    result = pays_study(out, size="tiny", workers=1)
    head = source_commit()
    for part in PAYS_PARTS:
        runs = list(csv.DictReader(open(out / part / "runs.csv")))
        assert runs and all(r["commit"] == head for r in runs), part
    table = list(csv.DictReader(open(out / "pays_study.csv")))
    assert {r["part"] for r in table} == set(PAYS_PARTS)
    switched = list(csv.DictReader(open(out / "pays_study_switch.csv")))
    assert [(r["horizon"], r["flush share K"]) for r in switched] == [("1×", "0%"), ("1×", "10%")]
    assert "**Synchronous, then asynchronous**" in result.markdown
    assert "Re-run of a published row at commit" in result.markdown
    # the tables come from the parts' CSVs alone: the published ones rebuild to docs/results.md's figures (the
    # analysis writes its tables beside the parts: a copy)
    shutil.copytree(OWN, tmp_path / "published")
    published = pays_study(tmp_path / "again", analyze=tmp_path / "published")
    assert "| default | 8 | deep-cpu | 4 | paci a=4 + muon + error feedback @4× | muon μ=0.95 | 0.01 (edge) | 3 | " \
           "1.053 ± 0.006 | 1.043 ± 0.004 (lr 0.01) | 0.009902 | 1.08, 1.15 | > 1.08, 1.08, 1.04 |" in published.markdown
    assert unpublished_rows(published.markdown) == []


def _run(method, seed, loss, budget=1.0, commit="c0ffee", schedule="1f1b-flush"):
    steps = round(10 * budget)
    return {"run_id": f"{method}-{seed}-{budget}", "method": method, "stages": 2, "lr": 1e-3, "seed": seed,
            "phase": "tune" if seed == 0 and budget == 1.0 else "seeds" if budget == 1.0 else "budget",
            "budget": budget, "schedule": schedule, "a": 2, "m": 2, "optimizer": "adamw", "steps": steps,
            "micro_batches": 2 * steps, "tokens": 64 * steps, "final_val_loss": loss, "commit": commit,
            "f_s": [0.01, 0.01], "b_s": [0.02, 0.02], "u_s": [0.001, 0.001]}


def test_overhead_is_paired_per_seed_and_marks_mixed_commits():
    """Flush ends at 1.0 (seed 0) and 1.2 (seed 1); PACI at 1.1 / 1.3 and, at 1.5× its tokens, 0.9 / 1.15.
    Paired, seed 0 meets 1.0 at 1.5^((1.1−1.0)/(1.1−0.9)) = 1.5^0.5 = 1.2247× and seed 1 meets 1.2 at
    1.5^(2/3) = 1.3104×: 1.27 ± 0.06. Against the twins' mean (1.1) seed 0 would read ≤ 1.00."""
    from unbubble.experiments.overhead import overhead_rows
    from unbubble.experiments.studies import Study
    from unbubble.experiments.sweep import SweepData

    runs = [_run("flush", 0, 1.0), _run("flush", 1, 1.2),
            _run("paci", 0, 1.1, schedule="paci"), _run("paci", 1, 1.3, schedule="paci"),
            _run("paci", 0, 0.9, 1.5, schedule="paci"), _run("paci", 1, 1.15, 1.5, commit="beef01", schedule="paci")]
    val = {r["run_id"]: [(v, v * 64, r["final_val_loss"] + 0.1 * (r["steps"] - v)) for v in range(0, r["steps"] + 1, 5)]
           for r in runs}
    spec = {"methods": [{"label": "flush", "schedule": "1f1b-flush", "m": 2},
                        {"label": "paci", "schedule": "paci", "a": 2, "baseline": "flush"}]}
    rows, facts = overhead_rows(Study(SweepData(runs, val)), spec, 2)
    f = facts["paci"]
    assert [v for v, _ in f["per_seed"]] == pytest.approx([1.5 ** 0.5, 1.5 ** (2 / 3)])
    assert rows[0]["token overhead ÷ flush"] == "1.27 ± 0.06 (1.22–1.31)"
    assert rows[0]["per seed (paired)"] == "s0 1.22, s1 1.31"
    assert f["commits"] == [["c0ffee"], ["beef01", "c0ffee"]] and f["mixed_commits"]
    assert rows[0]["commits"] == "mixed: beef01, c0ffee"


def test_a_switched_methods_clock_counts_its_synchronous_phase_at_flushs_speed():
    """A run that trained 2 of its 10 updates with 1F1B-flush: on the clock, 20 % of any number of updates
    run as 1F1B-flush (m = a = 2) and the rest as PACI; 1F1B-flush's updates take longer (its bubble)."""
    from unbubble.experiments.overhead import Clock
    from unbubble.experiments.studies import Study
    from unbubble.experiments.sweep import SweepData

    runs = [_run("flush", 0, 1.0), {**_run("switch", 0, 1.1, schedule="paci"), "switch_after": 2},
            _run("paci", 0, 1.2, schedule="paci")]
    clock = Clock(Study(SweepData(runs, {})), 2)
    flush2, paci8 = clock.makespan("switch", "1f1b-flush", 2, m=2), clock.makespan("switch", "paci", 8, a=2, m=2)
    assert clock.async_time("switch", 10) == pytest.approx(flush2 + paci8)
    assert clock.async_time("switch", 15) == pytest.approx(clock.makespan("switch", "1f1b-flush", 3, m=2)
                                                           + clock.makespan("switch", "paci", 12, a=2, m=2))
    assert clock.async_time("paci", 10) < clock.async_time("switch", 10) < clock.makespan("flush", "1f1b-flush", 10, m=2)
