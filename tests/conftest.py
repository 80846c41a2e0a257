"""Checks shared by every test."""

from pathlib import Path

import pytest

RUNS = Path(__file__).resolve().parents[1] / "runs"


@pytest.fixture(autouse=True)
def _no_run_folders_in_the_checkout(request):
    """A test writes its run folders under tmp_path (``--run-dir``, ``--out``), never into the
    checkout's runs/ (the default of ``unbubble train`` and ``unbubble simulate``), where they would
    be left behind."""
    before = set(RUNS.iterdir()) if RUNS.is_dir() else set()
    yield
    new = sorted(p.name for p in (set(RUNS.iterdir()) if RUNS.is_dir() else set()) - before)
    assert not new, f"{request.node.nodeid} wrote {new} into {RUNS}: give it --run-dir / --out under tmp_path"
