"""The process engine's launcher, checked without starting stage processes: a script that calls
it without a ``__main__`` guard (in a subprocess, as a user runs it)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import torch
    from unbubble.runtime.job import PipelineJob
    from unbubble.runtime.launch import check_main_guard, run_processes
    from unbubble.schedules import get_schedule


    def stage(i):
        return torch.nn.Linear(4, 4)


    def batch(k):
        return torch.randn(2, 4), torch.randn(2, 4)


    def optimizer(params, stage):
        return torch.optim.SGD(params, lr=0.1)


    job = PipelineJob(stage, torch.nn.functional.mse_loss, batch, optimizer, get_schedule("paci", 2, steps=2, a=1))
    if __name__ == "__main__":
        check_main_guard()
        print("a guarded call is accepted")
    result = run_processes(job)
''')


def test_a_script_without_main_guard_stops_at_once_with_one_line(tmp_path):
    script = tmp_path / "train_it.py"
    script.write_text(SCRIPT)
    # no stage process is started, none waited for: the script's own output once, one traceback
    # (the caller's), and no hang (the timeout)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stdout == "a guarded call is accepted\n"
    assert res.stderr.count("Traceback") == 1  # the caller's own, not the stages'
    assert res.stderr.strip().splitlines()[-1] == (
        f"unbubble.errors.ConfigError: run_processes was called from a script without an `if __name__ == "
        f"\"__main__\":` guard ({script}, line 24): each stage process starts by importing that script and would "
        "run it again; move the call under the guard")


def test_stage_processes_of_the_console_script_do_not_re_import_the_cli(tmp_path):
    # spawn re-imports the __main__ script in every stage process; for the `unbubble` console
    # script that was the whole CLI (click, rich, every command), which no stage uses
    script = tmp_path / "unbubble"
    script.write_text(textwrap.dedent('''
        import multiprocessing.spawn, sys
        from unbubble.cli import spawn_without_the_cli
        spawn_without_the_cli()
        data = multiprocessing.spawn.get_preparation_data("stage")
        print(data.get("init_main_from_path"), data.get("init_main_from_name"))
    '''))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "unbubble.__main__"], out.stderr  # multiprocessing skips *.__main__
    other = tmp_path / "train.py"  # a user's script is still re-imported (its functions may be in the job)
    other.write_text(script.read_text())
    out = subprocess.run([sys.executable, str(other)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [str(other), "None"], out.stderr


def test_a_stop_signal_sent_twice_at_once_is_one_stop_and_a_later_one_stops_at_once():
    # regression: `timeout -s INT` signals the command and its process group; the echo stopped the run
    # at once, without a checkpoint
    import signal
    import time

    from unbubble.runtime.launch import ECHO_S, install_stop_handlers
    from unbubble.schedules.policy import Cuts

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cuts = Cuts(mb_per_step=4)
        install_stop_handlers(cuts, announce=False)
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)
        assert cuts.stop_requested
        handler(signal.SIGINT, None)  # the echo: ignored
        time.sleep(ECHO_S + 0.05)
        with pytest.raises(KeyboardInterrupt, match="second SIGINT: stopped at once"):
            handler(signal.SIGINT, None)
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)


def test_a_second_signal_names_what_is_kept(tmp_path):
    # the line a second stop signal ends the run with says which checkpoint --resume continues from; the
    # first signal's own checkpoint counts once every stage's file is there
    from unbubble.runtime.checkpoint import Checkpointing, save_stage
    from unbubble.runtime.launch import stopped_at_once

    ck = Checkpointing(str(tmp_path / "checkpoints"), 5)
    assert stopped_at_once("SIGINT", None, 2) == "second SIGINT: stopped at once; checkpoints are off, so no step was kept"
    assert stopped_at_once("SIGTERM", ck, 2) == (
        "second SIGTERM: stopped at once, before any checkpoint was complete: --resume starts again from step 0")
    for stage in (0, 1):
        save_stage(ck.directory, 5, stage, {"x": stage})
    save_stage(ck.directory, 7, 0, {"x": 0})  # stage 1's file of the stop's checkpoint was cut short
    assert stopped_at_once("SIGINT", ck, 2, run_dir=tmp_path) == (
        f"second SIGINT: stopped at once; the newest complete checkpoint, step 5 ({tmp_path}/checkpoints/step-00000005), "
        f"is kept: unbubble train --resume {tmp_path} continues from it")
