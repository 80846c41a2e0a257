"""Each experiment in its tiny configuration: it writes its files with sane values."""

import pytest

from unbubble.experiments import EXPERIMENTS, ExperimentOutput, get_experiment, publish, update_results, write_section


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


def test_publish_is_the_only_writer_of_docs(tmp_path):
    """The experiment's folder gets its section as written; publish() puts it into docs/results.md
    with figure links under img/, copies the figure and the raw tables (not onto themselves)."""
    folder, docs = tmp_path / "experiments" / "x", tmp_path / "docs"
    folder.mkdir(parents=True)
    (folder / "x_plot.png").write_bytes(b"png")
    (folder / "runs.csv").write_text("run_id\nr0\n")
    out = ExperimentOutput("x", "## x\n\n![plot](x_plot.png)\n", [folder / "x_plot.png"], 1.0,
                           data=[folder / "runs.csv"])
    assert write_section(out, folder).read_text() == "## x\n\n![plot](x_plot.png)\n"
    assert not docs.exists()
    written = publish(out, docs)
    assert written == [docs / "results.md", docs / "img" / "x_plot.png", docs / "data" / "x" / "runs.csv"]
    assert "![plot](img/x_plot.png)" in (docs / "results.md").read_text()
    assert (docs / "img" / "x_plot.png").read_bytes() == b"png"
    assert (docs / "data" / "x" / "runs.csv").read_text() == "run_id\nr0\n"
    # --analyze docs/data/x --write-docs: the raw tables are already in place
    again = ExperimentOutput("x", "## x\n\nagain\n", [], 1.0, data=[docs / "data" / "x" / "runs.csv"])
    assert publish(again, docs) == [docs / "results.md"]
    assert (docs / "data" / "x" / "runs.csv").read_text() == "run_id\nr0\n"


def test_experiments_are_listed_in_order():
    assert list(EXPERIMENTS) == ["paci-study", "br-study", "overhead-study", "throughput-memory", "moe-delay"]


def test_unknown_experiment():
    from unbubble.errors import ConfigError

    with pytest.raises(ConfigError, match="experiment='nope' is unknown: valid experiments are paci-study, br-study"):
        get_experiment("nope")
