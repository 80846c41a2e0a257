"""The experiments that run real stage processes, in their tiny configuration."""

import csv
import math

import pytest

from unbubble.experiments import get_experiment

pytestmark = pytest.mark.multiproc


def test_time_to_accuracy_and_throughput_memory_tiny(tmp_path):
    tta = get_experiment("time-to-accuracy")(tmp_path / "tta", size="tiny")
    rows = list(csv.DictReader(open(tta.files[0])))
    assert {r["N"] for r in rows} == {"2", "8"}
    for r in rows:  # the untrained loss is ln 257 ≈ 5.55, so a target of 5.0 is reached by every run
        assert float(r["paci 4 s"]) > 0 and float(r["1f1b-flush 4 s"]) > 0
        assert math.isfinite(float(r["speed-up vs flush m=a"]))
    tm = get_experiment("throughput-memory")(tmp_path / "tm", size="tiny")
    rows = {r["schedule"]: r for r in csv.DictReader(open(tm.files[0]))}
    assert float(rows["paci"]["tok/s measured"]) > 0 and float(rows["1f1b-flush"]["tok/s predicted"]) > 0
    assert rows["1f1b-flush"]["peak activations (micro-batches) per stage"] == "[2, 1]"
