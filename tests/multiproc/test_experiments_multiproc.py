"""The experiments that run real stage processes, in their tiny configuration."""

import csv

import pytest

from unbubble.experiments import get_experiment

pytestmark = pytest.mark.multiproc


def test_throughput_memory_tiny(tmp_path):
    tm = get_experiment("throughput-memory")(tmp_path / "tm", size="tiny")
    rows = {r["schedule"]: r for r in csv.DictReader(open(tm.files[0]))}
    assert float(rows["paci"]["tok/s measured"]) > 0 and float(rows["1f1b-flush"]["tok/s predicted"]) > 0
    assert rows["1f1b-flush"]["peak activations (micro-batches) per stage"] == "[2, 1]"
