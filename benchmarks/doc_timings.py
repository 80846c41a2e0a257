"""Every time the docs state, measured in one run with the machine's load beside it.

The README, ``unbubble train --help``, ``unbubble bench --help`` and the experiment table quote how
long a command takes on a user's machine. Each figure comes from this script: it makes a fresh clone
of this checkout's committed ``HEAD`` (or reuses ``--clone``), then times, as a user runs them:

* ``install``: the README's install line (a virtual environment, torch 2.13.0's CPU build first, then
  ``pip install -e ".[dev,examples,fast,hf]"``, as ``.ci/run``);
* ``train``: ``unbubble train`` on its defaults, and the validation line it ends with;
* ``tests``: ``pytest`` (the README's second command), and its pass/skip line;
* ``bench``, ``plan``, ``simulate``: ``unbubble bench``, ``unbubble plan --model gpt2-medium --gpus
  8xH200`` and ``unbubble simulate --model gpt2-medium --recompute full`` as the README gives them;
* ``tiny``: every study of the experiment table at ``--size tiny``.

Beside each wall time it prints the 1-minute load average sampled every 5 s while the command ran
(mean and range) and the CPU count: a time on a loaded 2-core machine is not a time on an idle one,
so the docs quote the load with the figure. Results print as a markdown table and go to ``--out``
as JSON.

Usage::

    python benchmarks/doc_timings.py                          # everything, ~45 min on 2 cores
    python benchmarks/doc_timings.py --only plan,simulate     # the quick ones (this environment)
    python benchmarks/doc_timings.py --clone /tmp/c --only train,tests   # reuse an installed clone
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ("paci-study", "overhead-study", "br-study", "moe-delay", "throughput-memory")
PARTS = ("install", "train", "tests", "bench", "plan", "simulate", "tiny")


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while the block runs."""

    def __init__(self, every: float = 5.0):
        self.every, self.samples, self._stop = every, [], threading.Event()

    def __enter__(self):
        self.samples.append(os.getloadavg()[0])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def text(self) -> str:
        s = self.samples
        return f"{statistics.fmean(s):.1f} ({min(s):.1f}–{max(s):.1f})"


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def timed(name: str, command: str, cwd: Path, env: dict, pattern: str | None = None) -> dict:
    """Runs ``command`` (a shell line) in ``cwd``; returns its wall time, load and the last output
    line matching ``pattern``. A failing command is reported, not hidden."""
    print(f"[doc_timings] {name}: {command}", file=sys.stderr, flush=True)
    with LoadSampler() as load:
        t0 = time.perf_counter()
        res = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    out = res.stdout + res.stderr
    found = [line.strip() for line in out.splitlines() if pattern and re.search(pattern, line)]
    row = {"part": name, "command": command, "wall_s": round(wall, 1), "load": load.text(),
           "load_samples": load.samples, "rc": res.returncode, "result": found[-1] if found else ""}
    if res.returncode:
        row["tail"] = out[-2000:]
    print(f"[doc_timings] {name}: {minutes(wall)} at load {row['load']} (rc {res.returncode}) {row['result']}",
          file=sys.stderr, flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of: {', '.join(PARTS)}")
    ap.add_argument("--clone", type=Path, help="an existing clone to use (installed unless 'install' runs)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--only {bad[0]!r} is unknown: valid parts are {', '.join(PARTS)}")
    clone = args.clone
    if clone is None:
        clone = Path(tempfile.mkdtemp(prefix="doc-timings-")) / "unbubble"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        shared = ROOT.parent / "shared"
        if shared.is_dir() and not (clone.parent / "shared").exists():
            (clone.parent / "shared").symlink_to(shared)
    venv = clone / ".venv"
    if "install" not in parts and not (venv / "bin" / "unbubble").exists():
        venv = Path(sys.prefix)  # no install asked for: this environment runs the clone's commands
        print(f"[doc_timings] no environment in {clone}: using {venv}", file=sys.stderr)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "UNBUBBLE_CACHE_DIR": str(clone / ".cache" / "unbubble")}
    env.pop("PYTHONPATH", None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True,
                            text=True).stdout.strip()
    commands = {
        "install": ("python3 -m venv .venv && .venv/bin/pip install --quiet torch==2.13.0 && "
                    ".venv/bin/pip install --quiet -e '.[dev,examples,fast,hf]'", None),
        "train": ("unbubble train", r"^validation loss "),
        "tests": ("pytest -q -p no:cacheprovider", r"\d+ passed"),
        "bench": ("unbubble bench", r"tokens/s|ratio"),
        "plan": ("unbubble plan --model gpt2-medium --gpus 8xH200", None),
        "simulate": ("unbubble simulate --model gpt2-medium --recompute full", None),
    }
    rows = []
    for part in parts:
        if part == "tiny":
            for study in STUDIES:
                rows.append(timed(f"{study} --size tiny", f"unbubble experiment {study} --size tiny --out "
                                  f"{clone.parent / 'tiny-out'}", clone, env, r"wrote|results"))
            continue
        command, pattern = commands[part]
        rows.append(timed(part, command, clone, env, pattern))
    print(f"\nDoc timings at {commit}, {os.cpu_count()} CPUs ({Path('/proc/cpuinfo').exists() and _cpu()}), "
          f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| command | wall time | load (mean, range) | result |\n|---|---|---|---|")
    for r in rows:
        ok = "" if r["rc"] == 0 else f" **failed (rc {r['rc']})**"
        print(f"| `{r['command'] if r['part'] != 'install' else 'pip install (README)'}` | {minutes(r['wall_s'])}"
              f"{ok} | {r['load']} | {r['result']} |")
    if args.out:
        args.out.write_text(json.dumps({"commit": commit, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    return 1 if any(r["rc"] for r in rows) else 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
