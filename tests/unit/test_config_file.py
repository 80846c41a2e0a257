"""YAML configuration files (validation, CLI overrides, reproducing a run) and the run's loggers."""

import json
import logging
import sys
import types

import pytest
import torch
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.config import TrainConfig, config_from_dict, config_to_yaml, load_config
from unbubble.errors import ConfigError

SHORT = ["--engine", "emulator", "--steps", "3", "--stages", "2", "--a", "2", "--eval-interval", "0",
         "--eval-batches", "1", "--seq-len", "32"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def restore_logging():
    """The CLI installs its own handler and stops propagation; later tests' caplog needs it back."""
    logger = logging.getLogger("unbubble")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_yaml_round_trip_is_exact(tmp_path):
    for cfg in (TrainConfig(), TrainConfig(schedule="1f1b-flush", m=8, lr=1e-8, beta2=0.999, clip_grad_norm=0.5,
                                           corpus="my texts: 2024/", run_dir="runs/x y", stage_aware=True,
                                           tensorboard=False, optimizer="basis-rotation")):
        path = tmp_path / "c.yaml"
        path.write_text(config_to_yaml(cfg))
        again = load_config(path)
        assert again.to_dict() == cfg.to_dict()
        assert config_to_yaml(again) == path.read_text()


def test_file_values_types_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("schedule: 1f1b-flush\nm: 8\nlr: 1e-3\nmicro-batch-size: 4\nclip_grad_norm: 1\n")
    cfg = load_config(path, overrides={"m": 2})
    assert (cfg.schedule, cfg.m, cfg.lr, cfg.micro_batch_size, cfg.clip_grad_norm) == ("1f1b-flush", 2, 1e-3, 4, 1.0)
    assert isinstance(cfg.lr, float) and isinstance(cfg.clip_grad_norm, float)
    path.write_text("")
    assert load_config(path) == TrainConfig()


@pytest.mark.parametrize("text, message", [
    ("stpes: 3", "unknown key 'stpes' (did you mean 'steps'?): valid keys are schedule, stages,"),
    ("colour: red", "unknown key 'colour': valid keys are schedule, stages"),
    ("steps: '3'", "steps='3' has the wrong type str: expected an integer"),
    ("steps: 2.5", "steps=2.5 has the wrong type float: expected an integer"),
    ("lr: fast", "lr='fast' has the wrong type str: expected a number"),
    ("tensorboard: 1", "tensorboard=1 has the wrong type int: expected true or false"),
    ("seed:", "seed is empty (null): expected an integer"),
    ("engine: gpu", "engine='gpu' is invalid: must be one of emulator, processes"),
    ("order: dynamc", "order='dynamc' is invalid (did you mean 'dynamic'?): must be one of deterministic, dynamic"),
    ("a: 0", "run.yaml: a=0 is invalid: must be an integer ≥ 1 (set --a)"),
    ("- steps: 3", "expected a mapping of option names to values (key: value lines), got a list"),
    ("steps: [3", "not valid YAML at line 1, column 10"),
    ("steps: 3\nmicro_batch_size: 2\nmicro-batch-size: 2", "key 'micro_batch_size' is given twice"),
    # PyYAML keeps the last of duplicate keys silently
    ("steps: 3\nseed: 1\nsteps: 4", "run.yaml: key 'steps' is given twice (lines 1 and 3): keep one"),
])
def test_bad_files_one_clear_line(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert str(exc.value).startswith(str(path))


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="config='nope.yaml' does not exist"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match="^a=0 is invalid"):  # from the command line: no file named
        config_from_dict({"a": 3}, overrides={"a": 0}, where="run.yaml")
    with pytest.raises(ConfigError, match=r"^order='random' is invalid: must be one of deterministic, dynamic "
                                          r"\(set --order\)$"):  # the Python API
        TrainConfig(order="random")
    assert TrainConfig().order == "deterministic"


def _printed(args, tmp_path):
    res = CliRunner().invoke(cli, ["train", *args, "--print-config"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "printed.yaml"
    out.write_text(res.stdout)
    return load_config(out)


def test_cli_flags_given_explicitly_win_over_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 50\na: 2\nstages: 2\ntensorboard: false\nstage_aware: true\n")
    cfg = _printed(["--config", str(path), "--steps", "7", "--stages", "4"], tmp_path)
    assert (cfg.steps, cfg.a, cfg.stages, cfg.tensorboard, cfg.stage_aware) == (7, 2, 4, False, True)
    # a flag equal to its default still counts when given explicitly
    cfg = _printed(["--config", str(path), "--a", "4", "--tensorboard", "--no-stage-aware"], tmp_path)
    assert (cfg.steps, cfg.a, cfg.tensorboard, cfg.stage_aware) == (50, 4, True, False)
    res = CliRunner().invoke(cli, ["train", "--config", str(path), "--a", "0"])
    assert res.exit_code == 2 and "a=0 is invalid" in res.stderr
    path.write_text("stepz: 3\n")
    res = CliRunner().invoke(cli, ["train", "--config", str(path)])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "unknown key 'stepz' (did you mean 'steps'?)" in res.stderr


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "val_loss" not in line]


def test_run_from_saved_config_reproduces_it_exactly(tmp_path, cache_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(cli, ["train", *SHORT, "--cache-dir", cache_dir])
    assert res.exit_code == 0, res.output
    (first,) = (tmp_path / "runs").iterdir()
    res = runner.invoke(cli, ["train", "--config", str(first / "config.yaml")])
    assert res.exit_code == 0, res.output
    (second,) = set((tmp_path / "runs").iterdir()) - {first}
    assert (second / "config.yaml").read_text() == (first / "config.yaml").read_text()
    assert (second / "config.json").read_text() == (first / "config.json").read_text()
    assert _losses(second) == _losses(first)  # the emulator is deterministic: the same run again
    # a saved run_dir is refused (nothing is overwritten); a new one gives the same config otherwise
    again = TrainConfig(**{**json.loads((first / "config.json").read_text()), "run_dir": str(first)})
    (tmp_path / "named.yaml").write_text(config_to_yaml(again))
    res = runner.invoke(cli, ["train", "--config", "named.yaml"])
    assert res.exit_code == 2 and "already exists and is not empty" in res.stderr
    # TensorBoard event files by default, with the logged series
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(first), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "train/perplexity", "train/tokens_per_s", "val/loss", "val/perplexity",
            "utilization/rank_0", "utilization/rank_1", "simulated_utilization/rank_1"} <= set(tags["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert set(tags["histograms"]) == {"drift/stage_0", "drift/stage_1"}
    assert events.Histograms("drift/stage_0")[0].histogram_value.num == 6  # one Δ per micro-batch


def test_wandb_missing_is_one_clear_line(tmp_path, monkeypatch):
    import unbubble.loggers

    real = unbubble.loggers.importlib.util.find_spec
    monkeypatch.setattr(unbubble.loggers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    res = CliRunner().invoke(cli, ["train", *SHORT, "--wandb", "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2
    assert "wandb=True needs the wandb package, which is not installed: pip install wandb" in res.stderr
    assert not (tmp_path / "r").exists()


def test_wandb_offline_run_gets_the_metrics(tmp_path, cache_dir, monkeypatch):
    calls = []

    class FakeRun:
        summary = {}

        def define_metric(self, *a, **k):
            calls.append(("define_metric", a, k))

        def log(self, rec):
            calls.append(("log", rec))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    fake.Histogram = lambda np_histogram: ("histogram", np_histogram[0].tolist())
    fake.__spec__ = types.SimpleNamespace(name="wandb")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    import unbubble.loggers

    real = unbubble.loggers.importlib.util.find_spec
    monkeypatch.setattr(unbubble.loggers.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "wandb" else real(name, *a))
    run_dir = tmp_path / "r"
    res = CliRunner().invoke(cli, ["train", *SHORT, "--wandb", "--no-tensorboard", "--run-dir", str(run_dir),
                                   "--cache-dir", cache_dir])
    assert res.exit_code == 0, res.output
    init = calls[0][1]
    assert (init["mode"], init["dir"], init["config"]["schedule"]) == ("offline", str(run_dir), "paci")
    logged = [c[1] for c in calls if c[0] == "log"]
    assert [r["train/step"] for r in logged if "train/step" in r] == [1, 2, 3]
    assert [r["val/version"] for r in logged if "val/version" in r] == [0, 3]
    assert logged[-1]["drift/stage_0"] == ("histogram", [4, 2])  # 6 micro-batches, Δ ≤ ⌈(N−1)/a⌉ = 1
    assert calls[-1] == ("finish",) and FakeRun.summary["schedule"] == "paci"
    assert not list(run_dir.glob("events.out.tfevents*"))


def test_print_config_of_one_schedule_runs_with_another(tmp_path):
    """Issue 37 (tutorial §4): --print-config of paci wrote error_feedback: 1.0, which
    `--config paci.yaml --schedule 1f1b-flush` refused. A schedule-dependent default is written
    `auto` and reads back as the default of the run's schedule; another value stays as given."""
    res = CliRunner().invoke(cli, ["train", "--steps", "100", "--print-config"])
    assert res.exit_code == 0, res.output
    assert "\nerror_feedback: auto\n" in res.stdout
    path = tmp_path / "paci.yaml"
    path.write_text(res.stdout)
    for schedule, want in (("paci", 1.0), ("1f1b-flush", 0.0), ("zbv", 0.0), ("pipedream", 1.0)):
        assert load_config(path, overrides={"schedule": schedule}).error_feedback == want
    flush = CliRunner().invoke(cli, ["train", "--config", str(path), "--schedule", "1f1b-flush", "--print-config"])
    assert flush.exit_code == 0, flush.output
    assert "\nschedule: 1f1b-flush\n" in flush.stdout and "\nerror_feedback: auto\n" in flush.stdout
    assert "\nerror_feedback: 0.5\n" in config_to_yaml(TrainConfig(error_feedback=0.5))
    assert "\nerror_feedback: 0.0\n" in config_to_yaml(TrainConfig(error_feedback=0.0))  # off on paci: kept off
    assert load_config(path, overrides={"error_feedback": 0.0}).error_feedback == 0.0
