"""The docs: local links and pictures exist, the API reference generator runs."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/concepts.md", "docs/tutorial.md", "docs/faq.md", "docs/paper-to-code.md", "docs/experiments.md",
        "docs/results.md"]


def test_local_links_and_images_exist():
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (ROOT / doc).parent.joinpath(target).exists(), f"{doc} links to missing {target}"


def test_api_reference_documents_the_public_names_only_and_is_current():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    import unbubble

    headings = re.findall(r"^## `unbubble\.([^`]+)`", text, flags=re.M)
    assert headings == list(unbubble.__all__)
    for heading in ("### `unbubble.train_model(", "### class `unbubble.SchedulePACI(", "#### `SchedulePACI.step(",
                    "### `unbubble.export.export(", "### `unbubble.plan("):
        assert heading in text
    assert "load_config(" not in text and "## `unbubble.runtime" not in text  # internals stay out
    for target in re.findall(r"\]\(#([^)]+)\)", text):  # the list of names links to their sections
        assert any(gen._anchor(h) == target for h in re.findall(r"^## (.+)$", text, flags=re.M)), target
    assert (ROOT / "docs" / "api.md").read_text() == text, "docs/api.md is out of date: run python docs/gen_api.py"


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation but - and _ dropped, spaces as -)."""
    return {"".join(c for c in h.lower() if c.isalnum() or c in " -_").strip().replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, flags=re.M)}


def test_citations_of_architecture_md_name_sections_that_exist():
    """Code and docs cite a section of docs/architecture.md by its anchor (never the design notes outside the
    repository); every cited section exists."""
    anchors = _anchors((ROOT / "docs" / "architecture.md").read_text())
    cited = []
    for path in [*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]:
        text = path.read_text()
        cited += [(path.name, a) for a in re.findall(r"architecture\.md#([\w-]+)", text)]
    assert len(cited) > 20
    assert [c for c in cited if c[1] not in anchors] == []
    design = "DESIGN" + " §"  # the design notes outside the repository, which a user never has
    assert [p.name for p in [*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("docs/*.md")]
            if design in p.read_text() or "DESIGN" + ".md" in p.read_text()] == []


# The README's and the tutorial's command blocks, run as written (issue 37, item 1) -----------------------------
#
# Every fenced bash block of README.md and docs/tutorial.md runs here, command by command, in a fresh folder
# that stands for the user's clone (examples/ linked in), `unbubble ...` in-process through the CLI, `python ...`
# as a subprocess. A long command runs with tiny overrides appended (flags given later win): each is named in
# OVERRIDES below. A command this suite cannot run is named in NOT_RUN with the reason and, where there is one,
# the test that runs it. A command in neither table runs as written; a new command a doc adds runs too, so
# every block stays true. The tutorial's Python blocks run in tests/unit/test_split.py, the README's here.

import csv  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

TINY_TRAIN = ["--steps", "4", "--eval-interval", "2", "--eval-batches", "1", "--seq-len", "16",
              "--micro-batch-size", "2", "--engine", "emulator", "--no-tensorboard"]
#: (command prefix, what is appended); the first prefix that matches wins.
OVERRIDES = [
    ("unbubble train --resume", ["--engine", "emulator"]),  # a resume takes only how it runs
    ("unbubble train --help", []),
    ("unbubble train --dp 2", [*TINY_TRAIN, "--engine", "processes"]),  # replicas need processes
    ("unbubble train --compile", [*TINY_TRAIN, "--compile-backend", "aot_eager"]),  # no minutes of inductor
    ("unbubble train --steps 100 --eval-interval 25 --print-config", []),  # the tutorial's file, as written
    ("unbubble train", TINY_TRAIN),
    ("python examples/digits_mlp.py", ["--steps", "20"]),
]
NOT_RUN = {
    "python -m venv .venv": "makes the environment this suite runs in",
    "source .venv/bin/activate": "enters the environment this suite runs in",
    "pip install torch==2.13.0 -e \".[dev,examples,fast,hf]\"": "installs the environment this suite runs in (.ci/run)",
    "pytest": "the suite itself",
    "tensorboard --logdir runs": "a server that runs until stopped (the event files: tests/unit/test_train_cli.py)",
    "unbubble experiment overhead-study": "25–80 min on 2 cores (its --size tiny 138 s); the study's parts: "
                                          "tests/unit/test_overhead.py",
    "unbubble experiment paci-study --size tiny": "run as written by tests/unit/test_studies.py::"
                                                  "test_paci_study_tiny_values_and_analysis_from_the_csvs",
    "unbubble sweep examples/grid.yaml": "a grid of tens of minutes (its spec: tests/unit/test_studies.py::"
                                         "test_the_documented_sweep_spec_is_valid)",
}


def _placeholders(root, cache_dir):
    """What the README's examples name: runs/A (a run stopped at step 2 of 4), runs/B, path/to/texts/,
    data/ (pre-tokenised GPT-2 ids) and path/to/folder (a tiny untied GPT-2 config)."""
    from unbubble.cli import cli

    def train(*args):
        res = CliRunner().invoke(cli, ["-q", "train", *TINY_TRAIN, "--cache-dir", cache_dir, *args])
        assert res.exit_code == 0, res.output

    train("--run-dir", str(root / "runs" / "A"), "--checkpoint-every", "2")
    import shutil

    shutil.rmtree(root / "runs" / "A" / "checkpoints" / "step-00000004")  # as if stopped after step 2
    summary = json.loads((root / "runs" / "A" / "summary.json").read_text())
    (root / "runs" / "A" / "summary.json").write_text(json.dumps({**summary, "steps_done": 2}))
    train("--run-dir", str(root / "runs" / "B"), "--schedule", "1f1b-flush")
    texts = root / "path" / "to" / "texts"
    texts.mkdir(parents=True)
    (texts / "a.txt").write_text("".join(f"Line {i}: in the beginning was the word {i * 7 % 13}.\n"
                                         for i in range(3000)))
    (root / "data").mkdir()
    ids = np.random.default_rng(0).integers(0, 50257, size=40_000, dtype=np.uint16)
    ids[:30_000].tofile(root / "data" / "train.bin")
    ids[30_000:].tofile(root / "data" / "val.bin")
    import transformers

    transformers.GPT2Config(n_layer=4, n_head=2, n_embd=16, n_positions=32, vocab_size=50257, bos_token_id=0,
                            eos_token_id=0, tie_word_embeddings=False).save_pretrained(root / "path" / "to" / "folder")


def _run(command: str, root, cache_dir) -> str:
    """Runs one command in ``root`` (the cwd) with its overrides; returns its output."""
    from unbubble.cli import cli

    extra = next((more for prefix, more in OVERRIDES if command.startswith(prefix)), [])
    args = shlex.split(command)
    out_file = None
    if ">" in args:  # unbubble ... > file
        out_file, args = root / args[args.index(">") + 1], args[:args.index(">")]
    if args[0] == "unbubble":
        if args[1:2] == ["train"] and extra and "--help" not in args:
            extra = [*extra, "--cache-dir", cache_dir]
        res = CliRunner().invoke(cli, [*args[1:], *extra])
        assert res.exit_code == 0, f"{command} (+ {' '.join(extra)}): {res.output}"
        if out_file is not None:
            out_file.write_text(res.stdout)
        return res.output
    if args[0] == "python":
        res = subprocess.run([sys.executable, *args[1:], *extra], cwd=root, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, f"{command} (+ {' '.join(extra)}): {res.stdout}{res.stderr}"
        return res.stdout
    raise AssertionError(f"{command}: neither unbubble nor python: run it here or name it in NOT_RUN")


def _run_doc(doc, doc_blocks, root, cache_dir, monkeypatch) -> dict:
    """Every bash block of ``doc`` in order; returns {command: output} of those run."""
    from conftest import shell_commands

    monkeypatch.chdir(root)
    (root / "examples").symlink_to(ROOT / "examples")
    outputs, blocks = {}, [b for b in doc_blocks(doc) if b.lang == "bash"]
    assert blocks
    for block in blocks:
        for command in shell_commands(block.code):
            if command in NOT_RUN:
                continue
            t0 = time.perf_counter()
            outputs[command] = _run(command, root, cache_dir)
            print(f"{time.perf_counter() - t0:6.1f} s  {command}")
    print(f"{doc}: {len(blocks)} bash blocks, {len(outputs)} commands run, "
          f"{sum(c in NOT_RUN for b in blocks for c in shell_commands(b.code))} named in NOT_RUN")
    return outputs


@pytest.fixture(scope="module")
def doc_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_the_readme_runs_as_written(tmp_path, doc_blocks, doc_cache, monkeypatch):
    root = tmp_path / "clone"
    root.mkdir()
    _placeholders(root, doc_cache)
    outputs = _run_doc("README.md", doc_blocks, root, doc_cache, monkeypatch)
    assert re.search(r"^validation loss 5\.\d{4} -> \d\.\d{4} \(ppl ", outputs["unbubble train"], re.M)  # tiny
    assert any((root / "out").iterdir())  # unbubble export runs/A out/
    assert json.loads((root / "runs" / "A" / "summary.json").read_text())["steps_done"] == 4  # resumed
    python = [b for b in doc_blocks("README.md") if b.lang == "python"]
    assert len(python) == 1
    scope: dict = {}
    exec(compile(python[0].code, "README.md, Python API", "exec"), scope)  # noqa: S102
    assert scope["result"].max_drift() == [1, 1, 1, 0]


def test_the_tutorial_runs_as_written(tmp_path, doc_blocks, doc_cache, monkeypatch):
    """The tutorial's shell blocks in order; its figures that do not depend on the machine are this
    run's: §2's simulated bubbles and speed-up, §4's max Δ per stage and the config file's keys."""
    root = tmp_path / "clone"
    root.mkdir()
    outputs = _run_doc("docs/tutorial.md", doc_blocks, root, doc_cache, monkeypatch)
    rows = {r["schedule"]: r for r in csv.DictReader(open(root / "sim" / "summary.csv"))}
    flush, paci = rows["1f1b-flush (m=4)"], rows["paci (a=4)"]
    assert round(float(flush["mean_bubble"]), 2) == 0.43 and round(float(paci["mean_bubble"]), 3) == 0.045
    assert round(float(paci["speedup"]), 2) == 1.75 and (paci["max_drift"], flush["max_drift"]) == ("1", "0")
    printed = (root / "paci.yaml").read_text()
    for line in ("schedule: paci", "stages: 4", "a: 4", "m: 4", "micro_batch_size: 8", "seq_len: 128", "steps: 100",
                 "error_feedback: auto"):
        assert f"\n{line}\n" in printed
    paci_run = outputs["unbubble train --config paci.yaml --run-dir runs/paci"]
    assert "run folder: runs/paci" in paci_run and "max Δ per stage [1, 1, 1, 0]" in paci_run
    assert "max Δ per stage [0, 0, 0, 0]" in outputs["unbubble train --config paci.yaml --schedule 1f1b-flush "
                                                       "--run-dir runs/flush"]
    assert (root / "report" / "report.md").is_file()
