"""``unbubble train --switch-after K``: 1F1B-flush for the first K updates, then PACI (``unbubble/switch.py``),
against the two phases run separately: the first K updates of a whole 1F1B-flush run, and PACI started from
that run's checkpoint of update K."""

from __future__ import annotations

import pytest
import torch

from unbubble.config import TrainConfig
from unbubble.errors import ConfigError
from unbubble.train import train

K, T = 2, 4  # a checkpoint every K updates keeps two: step K survives the whole flush run


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _cfg(cache_dir: str, run_dir, **kw) -> TrainConfig:
    base = dict(engine="emulator", model="tiny", stages=2, steps=T, seq_len=32, micro_batch_size=2, eval_interval=0,
                eval_batches=1, optimizer="adamw", lr=1e-2, warmup_min=2, cache_dir=cache_dir, run_dir=str(run_dir),
                tensorboard=False)
    return TrainConfig(**{**base, **kw})


def _files(checkpoints, step: int) -> list[dict]:
    return [torch.load(checkpoints / f"step-{step:08d}" / f"stage-{s:03d}.pt", weights_only=True)["executor"]
            for s in range(2)]


def _same(a, b) -> float:
    """Largest absolute difference over two nested state dicts (inf where their structure differs)."""
    if isinstance(a, torch.Tensor):
        return (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("inf")
    if isinstance(a, dict):
        return max([_same(a[k], b[k]) for k in a] or [0.0]) if a.keys() == b.keys() else float("inf")
    if isinstance(a, (list, tuple)):
        return max([_same(x, y) for x, y in zip(a, b)] or [0.0]) if len(a) == len(b) else float("inf")
    return 0.0 if a == b else float("inf")


def test_switch_equals_a_flush_runs_first_k_updates_then_paci_from_its_checkpoint(tmp_path, cache_dir):
    """PACI (a = 2) with error feedback, switched after K = 2 of T = 4 updates. Reference: a whole 1F1B-flush run
    of T updates (m = 2) with a checkpoint at K, whose first K updates must be phase 1 (same learning-rate
    schedule, weights and AdamW moments at K: max difference 0), then PACI from that checkpoint (equal final
    weights, losses); the switched run's PACI phase attains the drift bound ⌈(N−i)/a⌉ = 1 on stage 0."""
    run = tmp_path / "switched"
    result, out = train(_cfg(cache_dir, run, schedule="paci", a=2, switch_after=K, error_feedback=1.0))
    assert out == run.resolve() and (run / "synchronous" / "summary.json").is_file()
    assert len(result.step_losses) == T and result.start_step == 0

    flush = tmp_path / "flush"
    whole, _ = train(_cfg(cache_dir, flush, schedule="1f1b-flush", m=2, checkpoint_every=K))
    assert _same(_files(run / "synchronous" / "checkpoints", K), _files(flush / "checkpoints", K)) == 0.0
    assert result.step_losses[:K] == whole.step_losses[:K]

    paci, _ = train(_cfg(cache_dir, tmp_path / "paci", schedule="paci", a=2, error_feedback=1.0,
                         init_from=str(flush / "checkpoints" / f"step-{K:08d}")))
    diff = max((result.final_states[s][k] - v).abs().max().item() for s in range(2)
               for k, v in paci.final_states[s].items())
    print(f"switch after {K} of {T}: max weight difference {diff} against the two phases run separately")
    assert diff == 0.0 and result.step_losses[K:] == paci.step_losses
    assert result.max_drift()[0] == 1  # PACI's bound on stage 0 of 2 with a = 2, attained after the switch
    assert whole.step_losses[K:] != paci.step_losses  # the asynchronous phase does differ from flush


@pytest.mark.parametrize("kw,message", [
    ({"schedule": "1f1b-flush", "switch_after": 2},
     "switch_after=2 is invalid with schedule='1f1b-flush': it switches a run from 1F1B-flush to an asynchronous "
     "schedule (paci, async-1f1b, paci-stashed, pipedream, pipemare; set --schedule)"),
    ({"schedule": "paci", "switch_after": 4},
     "switch_after=4 is invalid with steps=4: the switch must come before the last update (give 1 … 3; set "
     "--switch-after)"),
    ({"schedule": "paci", "switch_after": 2, "checkpoints": False},
     "switch_after=2 cannot be combined with checkpoints=False: the synchronous phase's checkpoint starts the "
     "asynchronous one, on the whole run's learning-rate schedule (drop --no-checkpoints)"),
    ({"schedule": "paci", "lr_steps": 3}, "lr_steps=3 is invalid: must be an integer ≥ 4 (set --lr-steps)"),
])
def test_bad_switches_are_refused_in_one_line(tmp_path, cache_dir, kw, message):
    with pytest.raises(ConfigError) as info:
        train(_cfg(cache_dir, tmp_path / "r", **kw))
    assert str(info.value) == message
    assert not (tmp_path / "r").exists()


def test_the_cli_and_train_model_run_a_switch_to_its_end(tmp_path, cache_dir):
    """``unbubble train --switch-after`` (and ``train_model(switch_after=)``) gave phase 2 phase 1's (closed)
    progress writer: "ValueError: I/O operation on closed file" at update K + 1, the run folder left without
    its config. Reference: the same switched run through :func:`train` (checked against the two phases run
    separately above); the CLI's metrics.jsonl holds its losses of updates K + 1 … T, the synchronous
    phase's those of 1 … K."""
    import json

    from click.testing import CliRunner

    from unbubble.cli import cli

    ref, _ = train(_cfg(cache_dir, tmp_path / "ref", schedule="paci", a=2, switch_after=K))
    run = tmp_path / "cli"
    res = CliRunner().invoke(cli, [
        "-q", "train", "--engine", "emulator", "--model", "tiny", "--stages", "2", "--steps", str(T), "--seq-len",
        "32", "--micro-batch-size", "2", "--eval-interval", "0", "--eval-batches", "1", "--optimizer", "adamw",
        "--lr", "1e-2", "--warmup-min", "2", "--cache-dir", cache_dir, "--no-tensorboard", "--schedule", "paci",
        "--a", "2", "--switch-after", str(K), "--run-dir", str(run)])
    assert res.exit_code == 0, res.output

    def losses(folder):
        return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(line) and "step" in json.loads(line)]

    assert losses(run / "synchronous") == ref.step_losses[:K] and losses(run) == ref.step_losses[K:]
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    # the end line starts from the synchronous phase's step-0 evaluation, not the run folder's first (its last)
    first, last = ref.val_losses[0], ref.val_losses[-1]
    assert first[0] == 0 and last[0] == T
    assert f"validation loss {first[1]:.4f} -> {last[1]:.4f} (ppl" in res.output, res.output

