"""Exports that cannot destroy a run (issue 33, item 5; [Note: what an export writes] in docs/architecture.md):
refused destinations, one line each; --force says what it replaced; unbubble train writes the last
step's weights by default, so train then export works; bf16 runs export their fp32 masters; an untied
run's export stays untied."""

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.errors import ConfigError
from unbubble.export import export, load_export, merged_state_dict
from unbubble.runtime.checkpoint import Checkpointing, load_stage
from unbubble.runtime.emulator import run_emulator
from unbubble.schedules import get_schedule
from helpers import tiny_gpt_job

torch.set_num_threads(1)

TRAIN = ["-q", "train", "--engine", "emulator", "--stages", "2", "--a", "2", "--steps", "2", "--seq-len", "32",
         "--eval-interval", "0", "--eval-batches", "1", "--no-tensorboard"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``unbubble train`` with default flags (2 steps, far fewer than --checkpoint-every): its run folder."""
    root = tmp_path_factory.mktemp("export")
    res = CliRunner().invoke(cli, [*TRAIN, "--cache-dir", str(root / "cache"), "--run-dir", str(root / "run")])
    assert res.exit_code == 0, res.output
    return root / "run"


def _error(args):
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0].removeprefix("error: ")


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_then_export_works_with_default_flags(run, tmp_path):
    """unbubble train writes the last step's weights by default (--no-final-checkpoint turns it off)."""
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]
    res = CliRunner().invoke(cli, ["export", str(run), str(tmp_path / "w.pt")])
    assert res.exit_code == 0, res.output
    state = torch.load(tmp_path / "w.pt", weights_only=True)
    final = load_stage(run / "checkpoints", 2, 1)["executor"]["model"]
    assert all(torch.equal(state[k], v) for k, v in final.items()) and len(state) > len(final)


def test_refused_destinations_are_one_line_each_and_leave_the_run_as_it_was(run, tmp_path):
    before = _files(run)
    other = tmp_path / "other-run"  # another run folder: config.yaml beside checkpoints/
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("steps: 2\n")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    old = tmp_path / "old.pt"
    old.write_bytes(b"precious")
    never = ("export never writes into a run (it would overwrite the run's own files, and --force does not change "
             "that): give OUT outside it")
    for args, message in [
        ([run, run], f"out='{run}' is the run folder '{run}': {never}"),
        ([run, run / "model.pt"], f"out='{run / 'model.pt'}' is inside the run folder '{run}': {never}"),
        ([run, run / "checkpoints" / "hf", "--force"],
         f"out='{run / 'checkpoints' / 'hf'}' is inside the run folder '{run / 'checkpoints'}': {never}"),
        ([run / "checkpoints", run / "hf"], f"out='{run / 'hf'}' is inside the run folder '{run}': {never}"),
        ([run, other / "hf"], f"out='{other / 'hf'}' is inside the run folder '{other}': {never}"),
        ([run, full], f"out='{full}' is a folder that is not empty: give a new or empty folder, or --force to write "
                      "into it (replacing the files of the same names)"),
        ([run, old], f"out='{old}' already exists: give a new path, or --force to replace that file"),
        ([run, full / "notes.txt"], f"out='{full / 'notes.txt'}' is a file: give a folder path, or one ending in .pt "
                                    "for a state dict file"),
        ([run, full, "--step", "1"], f"out='{full}' is a folder that is not empty: give a new or empty folder, or "
                                     "--force to write into it (replacing the files of the same names)"),
        ([tmp_path / "nowhere", tmp_path / "x.pt"], f"run_dir='{tmp_path / 'nowhere'}' does not exist: give a run "
                                                    "folder (unbubble train's --run-dir) or its checkpoints/ folder"),
        ([old, tmp_path / "x.pt"], f"run_dir='{old}' is a file, not a folder: give a run folder (unbubble train's "
                                   "--run-dir) or its checkpoints/ folder"),
    ]:
        assert _error(["export", *map(str, args)]) == message
    assert _files(run) == before and old.read_bytes() == b"precious" and (full / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "x.pt").exists()


def test_force_replaces_a_file_and_says_so(run, tmp_path, caplog):
    old = tmp_path / "old.pt"
    old.write_bytes(b"precious")
    with caplog.at_level(logging.WARNING, logger="unbubble.export"):
        assert export(run, old, force=True) == old
    assert [r.getMessage() for r in caplog.records if r.name == "unbubble.export"] == [
        f"--force: replaced old.pt in {tmp_path}"]
    assert set(torch.load(old, weights_only=True)) == set(merged_state_dict(run))
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbubble.export"):
        assert export(run, full, force=True) == full / "model.pt"  # a preset run: a state dict inside the folder
    assert [r for r in caplog.records if r.name == "unbubble.export"] == []
    assert (full / "notes.txt").read_text() == "mine"


def test_exporting_a_run_that_still_trains_says_which_step_it_holds(run, tmp_path, caplog):
    lock = run / ".lock"
    try:
        for pid, says in ((os.getpid(), True), (_gone_pid(), False)):  # a live holder; a stale lock
            lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "2026-12-06 10:00:00"}))
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="unbubble.export"):
                export(run, tmp_path / f"{pid}.pt")
            lines = [r.getMessage() for r in caplog.records if r.name == "unbubble.export"]
            assert lines == ([f"{run} is still training (process {pid} on {socket.gethostname()}, started 2026-12-06 "
                              "10:00:00): this export holds step 2, not the run's final weights; export again when "
                              "it ends"] if says else [])
    finally:
        lock.unlink(missing_ok=True)


def test_an_export_while_the_run_trains_holds_the_step_its_warning_names(run, tmp_path, caplog):
    import shutil

    from unbubble.runtime.checkpoint import stage_path

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"}))
    directory = copy / "checkpoints"

    class Trainer(logging.Handler):  # the run completes step 3's checkpoint right after the warning is said
        def emit(self, record):
            if "still training" in record.getMessage() and not (directory / "step-00000003").exists():
                shutil.copytree(directory / "step-00000002", directory / "step-00000003")
                path = stage_path(directory, 3, 1)
                payload = torch.load(path, weights_only=False)
                for t in payload["executor"]["model"].values():
                    t.add_(1)
                torch.save(payload, path)

    logger = logging.getLogger("unbubble.export")
    logger.addHandler(trainer := Trainer(logging.WARNING))
    try:
        with caplog.at_level(logging.WARNING, logger="unbubble.export"):
            export(copy, tmp_path / "w.pt")
            said = [r.getMessage() for r in caplog.records if r.name == "unbubble.export"]
            assert len(said) == 1 and "this export holds step 2," in said[0]
            state = torch.load(tmp_path / "w.pt", weights_only=True)
            step2 = load_stage(directory, 2, 1)["executor"]["model"]
            assert all(torch.equal(state[k], v) for k, v in step2.items())  # step 3 has every weight + 1
            step3 = load_stage(directory, 3, 1)["executor"]["model"]
            assert not any(torch.equal(state[k], v) for k, v in step3.items())
            caplog.clear()  # a step with no checkpoint: the error lists the complete ones, no warning names it
            with pytest.raises(ConfigError, match=r"^step=99 has no complete checkpoint .*: complete steps are 2, 3 "):
                export(copy, tmp_path / "x.pt", step=99)
            assert [r for r in caplog.records if r.name == "unbubble.export"] == []
    finally:
        logger.removeHandler(trainer)


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_no_checkpoint_names_the_flag_that_would_have_written_one(tmp_path):
    cache = str(tmp_path / "cache")
    for name, flag, why in [
        ("nofinal", "--no-final-checkpoint", "the run was trained with --no-final-checkpoint and 2 steps, fewer than "
                                             "--checkpoint-every 100; train it again without --no-final-checkpoint"),
        ("none", "--no-checkpoints", "the run was trained with --no-checkpoints; train it again without that flag"),
    ]:
        res = CliRunner().invoke(cli, [*TRAIN, flag, "--cache-dir", cache, "--run-dir", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        assert _error(["export", str(tmp_path / name), str(tmp_path / f"{name}.pt")]) == (
            f"'{tmp_path / name}' holds no checkpoint (no step-* folder in it or in its checkpoints/): {why}")


def test_bf16_exports_the_fp32_masters_a_resume_starts_from(tmp_path):
    """Regression: export merged the bf16 parameters. Each exported tensor is the stage file's fp32
    master, bit for bit; the masters carry bits below bf16 (so the bf16 parameters were not them)."""
    job = dataclasses.replace(tiny_gpt_job(get_schedule("paci", 2, steps=3, a=2)), precision="bf16",
                              checkpoint=Checkpointing(str(tmp_path / "ck")))
    run_emulator(job)
    state = torch.load(export(tmp_path / "ck", tmp_path / "m.pt"), weights_only=True)
    finer = 0
    for s in range(2):
        ex = load_stage(tmp_path / "ck", 3, s)["executor"]
        assert len(ex["master_names"]) == len(ex["masters"]) > 0
        for name, master in zip(ex["master_names"], ex["masters"]):
            assert state[name].dtype == torch.float32 and torch.equal(state[name], master), name
            assert torch.equal(ex["model"][name], master.to(torch.bfloat16))  # the bf16 parameter: rounded
            finer += not torch.equal(master, master.to(torch.bfloat16).float())
    assert finer > 0
    assert all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())


def test_a_bf16_checkpoint_without_master_names_is_refused(tmp_path):
    job = dataclasses.replace(tiny_gpt_job(get_schedule("1f1b-flush", 2, steps=1, m=2)), precision="bf16",
                              checkpoint=Checkpointing(str(tmp_path)))
    run_emulator(job)
    path = tmp_path / "step-00000001" / "stage-000.pt"
    data = torch.load(path, weights_only=True)
    del data["executor"]["master_names"]  # as written before the names were stored
    torch.save(data, path)
    with pytest.raises(ConfigError) as info:
        merged_state_dict(tmp_path)
    assert str(info.value) == (f"checkpoint file '{path}' was trained with --precision bf16 but does not name its fp32 "
                               "master weights (written by an older unbubble): exporting its bf16 parameters would "
                               "drop the masters' low bits; export a checkpoint written by this version")


def test_an_untied_export_is_refused_by_a_tied_model_and_loads_into_an_untied_one(tmp_path, caplog):
    """Regression: the untied GPT-2 .pt loaded with strict=True into the tied class and kept only the
    head copy. The folder export's config is untied; the .pt records the untied names."""
    pytest.importorskip("transformers")
    from helpers import hf_job, lm_batch, tiny_hf_gpt2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untie=True warns (tested in test_split)
        job = dataclasses.replace(hf_job(tiny_hf_gpt2(tie=True), "1f1b-flush", 2, untie=True),
                                  checkpoint=Checkpointing(str(tmp_path / "ck")))
    run_emulator(job)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbubble.export"):
        out = export(tmp_path / "ck", tmp_path / "gpt2.pt")
    pair = "transformer.wte.weight and lm_head.weight"
    assert [r.getMessage() for r in caplog.records if r.name == "unbubble.export"] == [
        f"{out}: {pair} were trained untied (separate tensors): load it into a model built untied "
        "(tie_word_embeddings=False); a tied model keeps only one of them (unbubble.export.load_export refuses that)"]
    state = torch.load(out, weights_only=True)
    assert not torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])  # two trained tensors
    with pytest.raises(ConfigError) as info:
        load_export(tiny_hf_gpt2(tie=True), out)
    assert str(info.value) == (
        f"'{out}' holds transformer.wte.weight and lm_head.weight as separate tensors (trained untied), but they are "
        "one tied tensor in this GPT2LMHeadModel: loading would keep only one; build the model untied (e.g. "
        "tie_word_embeddings=False) and load again")
    untied = tiny_hf_gpt2(tie=False)
    load_export(untied, out)
    assert torch.equal(untied.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(untied.transformer.wte.weight, state["transformer.wte.weight"])
    folder = export(tmp_path / "ck", tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    (folder / "README.md").write_text("mine")  # an HF folder again, with --force: what it replaced, said
    with pytest.raises(ConfigError, match="is a folder that is not empty"):
        export(tmp_path / "ck", folder)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbubble.export"):
        export(tmp_path / "ck", folder, force=True)
    written = sorted(p.name for p in folder.iterdir() if p.name != "README.md")
    assert "model.safetensors" in written and (folder / "README.md").read_text() == "mine"
    assert [r.getMessage() for r in caplog.records if r.name == "unbubble.export"] == [
        f"--force: replaced {', '.join(written)} in {folder}"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    x, _ = lm_batch(False, 99)
    with torch.no_grad():
        import transformers

        loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
        assert torch.equal(loaded(**x).logits, untied(**x).logits)
