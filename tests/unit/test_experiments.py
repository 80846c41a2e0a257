"""Each experiment in its tiny configuration: it writes its files with sane values."""

import csv
import math

import pytest

from unbubble.experiments import EXPERIMENTS, get_experiment, update_results


# time-to-accuracy and throughput-memory spawn processes: tests/multiproc/test_experiments_multiproc.py;
# paci-stability has its own test below
@pytest.mark.parametrize("name", ["delay-scaling", "br-ablation"])
def test_experiment_tiny(name, tmp_path):
    assert name in EXPERIMENTS
    output = get_experiment(name)(tmp_path / name, size="tiny")
    assert output.files and all(f.exists() and f.stat().st_size > 0 for f in output.files)
    rows = list(csv.DictReader(open(output.files[0])))
    assert rows
    numbers = []
    for row in rows:
        for value in row.values():
            try:
                numbers.append(float(value))
            except ValueError:
                pass  # labels, True/False, empty (target not reached)
    assert numbers and all(math.isfinite(x) for x in numbers)
    doc = tmp_path / "results.md"
    update_results(doc, name, output.markdown)
    update_results(doc, name, output.markdown)  # replacing a section keeps one copy
    assert doc.read_text().count(f"<!-- experiment:{name} -->") == 1


def test_paci_stability_tiny_values(tmp_path):
    output = get_experiment("paci-stability")(tmp_path, size="tiny")
    rows = {r["schedule"]: r for r in csv.DictReader(open(output.files[0]))}
    for label, row in rows.items():
        assert float(row["val_loss"]) < math.log(257)  # below the untrained model's loss
        assert int(row["max_drift"]) == int(row["bound"])  # Δ_max = ⌈(N−1)/a⌉ (0 for flush)
    assert set(rows) == {"1f1b-flush m=8", "paci a=1", "paci a=2", "paci a=4", "paci a=8"}


def test_unknown_experiment():
    from unbubble.errors import ConfigError

    with pytest.raises(ConfigError, match="experiment='nope' is unknown: valid experiments are paci-stability"):
        get_experiment("nope")
