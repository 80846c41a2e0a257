"""Each experiment in its tiny configuration: it writes its files with sane values."""

import pytest

from unbubble.experiments import EXPERIMENTS, get_experiment, update_results


# paci-study and br-study: tests/unit/test_studies.py; throughput-memory spawns processes:
# tests/multiproc/test_experiments_multiproc.py
def test_results_section_is_replaced_not_repeated(tmp_path):
    doc = tmp_path / "results.md"
    update_results(doc, "x", "## x\n\nfirst")
    update_results(doc, "y", "## y\n\nother")
    update_results(doc, "x", "## x\n\nsecond")
    text = doc.read_text()
    assert text.count("<!-- experiment:x -->") == 1 and "second" in text and "first" not in text
    assert text.index("experiment:x") < text.index("experiment:y")  # in place


def test_experiments_are_listed_in_order():
    assert list(EXPERIMENTS) == ["paci-study", "br-study", "overhead-study", "throughput-memory", "moe-delay"]


def test_unknown_experiment():
    from unbubble.errors import ConfigError

    with pytest.raises(ConfigError, match="experiment='nope' is unknown: valid experiments are paci-study, br-study"):
        get_experiment("nope")
