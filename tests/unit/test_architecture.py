"""The house's shape: the library never imports its command line, and what a run shows is one
module's (progress.py) for ``unbubble train`` and ``unbubble.train_model`` alike."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import unbubble

SRC = Path(unbubble.__file__).parent


def test_no_module_outside_the_cli_imports_the_cli():
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "cli" and path.parent.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(SRC)}: {n}" for n in names if n == "unbubble.cli" or
                          n.startswith("unbubble.cli.")]
    assert offenders == []


def test_train_model_in_a_plain_script_prints_the_step_lines_and_the_clis_end_lines(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from torch import nn
        import unbubble

        class Titan(nn.Module):
            def __init__(self):
                super().__init__()
                self.tok_embeddings = nn.Embedding(257, 16)
                self.layers = nn.ModuleDict({{str(i): nn.Linear(16, 16) for i in range(2)}})
                self.norm, self.output = nn.LayerNorm(16), nn.Linear(16, 257)

            def forward(self, tokens):
                h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
                for layer in self.layers.values():
                    h = layer(h)
                h = self.norm(h) if self.norm is not None else h
                return self.output(h) if self.output is not None else h

        torch.manual_seed(0)
        unbubble.train_model(Titan(), schedule="paci", stages=2, a=2, steps=4, seq_len=12, micro_batch_size=2,
                             engine="emulator", eval_interval=0, run_dir={str(tmp_path / "run")!r},
                             cache_dir={str(tmp_path / "cache")!r})
    """)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "step 4/4 | loss" in out.stderr  # no logging configured by the script: train_model shows them
    lines = out.stdout.splitlines()
    assert lines[0] == f"run folder: {tmp_path / 'run'}"
    assert lines[1].startswith("validation loss 5.") and " -> " in lines[1]  # evaluated at the end of the run
    assert lines[2].startswith("tokens/s ") and "max Δ per stage [1, 0]" in lines[2]
    assert lines[3].startswith("break-even: on these stages' measured costs this schedule is")
