"""Every causal-LM family of the installed transformers, split and trained against its unsplit self.

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
(``unbubble.models.hf_zoo``: a tiny random-init config with the family's features switched on):

* whether the unsplit model's own forward/backward runs on the CPU in fp32 (else "cannot run unsplit");
* each feature's effect: max |logit difference| with the feature switched off (same weights);
* ``split_model`` on 2 and 4 stages (a refusal is recorded with its line), 1F1B-flush trained 2
  updates × 2 micro-batches on the emulator against the unsplit model's own loop
  (``hf_zoo.train_unsplit``: ``model(**batch).logits``, torch's cross-entropy, one AdamW): max
  |difference| of the losses and of every final weight;
* PACI (a=2) on the deepest split: its largest drift per stage against ⌈(N−i)/a⌉.

Prints a markdown table and counts; ``--json`` writes every verdict, ``--markdown`` the table.

Usage::

    python benchmarks/hf_families.py                       # every family, ~5 min on 2 CPU cores
    python benchmarks/hf_families.py llama mistral gemma2  # some
    python benchmarks/hf_families.py --json out.json --markdown table.md
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import sys
import warnings

import torch


def fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return "0" if x == 0 else f"{x:.2g}"


def row(v) -> str:
    feats = ", ".join(f"{name} ({fmt(v.changed.get(name))})" if v.changed.get(name) is not None else name
                      for name in v.features) or "–"
    diffs = " / ".join(fmt(v.diffs.get(n)) for n in (2, 4)) if v.diffs else "–"
    paci = "–" if v.drift is None else ("attained" if v.drift == v.bound else f"{v.drift} vs {v.bound}")
    detail = v.detail.replace("|", "\\|")
    return f"| `{v.family}` | {feats} | {v.kind} | {diffs} | {paci} | {detail} |"


HEADER = ("| family | features switched on (max logit change when off) | verdict | max difference, 2 / 4 stages "
          "| PACI drift bound | why (refusal line, error) |\n|---|---|---|---|---|---|")


def counts(verdicts) -> str:
    by = collections.Counter(v.kind for v in verdicts)
    refused = collections.Counter(v.detail.split(":")[0] if v.kind == "refused" else None for v in verdicts)
    refused.pop(None, None)
    lines = [f"{len(verdicts)} families: " + ", ".join(f"{k} {n}" for k, n in by.most_common()),
             f"silently wrong (the probe passed, training differs from the unsplit loop): {by['differs']}"]
    lines += [f"  refused {n}: {why}" for why, n in refused.most_common()]
    return "\n".join(lines)


TEST = "tests/unit/test_hf_all_families.py"
BEGIN, END = "# --- verdicts: begin (benchmarks/hf_families.py --update-test) ---", "# --- verdicts: end ---"


def update_test(verdicts) -> None:
    """Rewrites the ``VERDICTS`` table between the markers of :data:`TEST`: per family
    ``(verdict, its line, the features whose switch changes the logits)``."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / TEST
    text = path.read_text()
    head, rest = text.split(BEGIN)
    table, tail = rest.split(END)
    rows = {line.split(":")[0].strip().strip("'"): line for line in table.splitlines() if line.startswith("    '")}
    for v in verdicts:  # a run of some families updates their rows only
        changing = tuple(name for name, d in v.changed.items() if d and d > 1e-4) if v.kind == "exact" else ()
        rows[v.family] = f"    {v.family!r}: ({v.kind!r}, {v.detail!r}, {changing!r}),"
    lines = [BEGIN, "VERDICTS: dict[str, tuple[str, str, tuple[str, ...]]] = {", *(rows[k] for k in sorted(rows))]
    lines += ["}", END]
    path.write_text(head + "\n".join(lines) + tail)


DOCS = "docs/models.md"
DOCS_BEGIN, DOCS_END = "<!-- families: begin (benchmarks/hf_families.py --update-docs) -->", "<!-- families: end -->"


def update_docs(verdicts, summary: str) -> None:
    """Rewrites the table of every family between the markers of :data:`DOCS`."""
    import pathlib
    import platform

    import transformers

    path = pathlib.Path(__file__).resolve().parents[1] / DOCS
    text = path.read_text()
    body = [DOCS_BEGIN, f"transformers {transformers.__version__}, torch {torch.__version__}, "
            f"{platform.machine()} CPU, fp32, eager attention.", "", "```", summary, "```", "", HEADER,
            *(row(v) for v in verdicts), DOCS_END]
    head, rest = text.split(DOCS_BEGIN)
    _, tail = rest.split(DOCS_END)
    path.write_text(head + "\n".join(body) + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: every causal LM of transformers)")
    parser.add_argument("--json", help="write every verdict here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--from-json", help="tabulate the verdicts a run wrote with --json instead of running")
    parser.add_argument("--update-docs", action="store_true",
                        help=f"rewrite the family table of {DOCS} with what this run found")
    parser.add_argument("--update-test", action="store_true",
                        help=f"rewrite the verdict table of {TEST} with what this run found (review the diff)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    from unbubble.models import hf_zoo
    from unbubble.testing import Verdict, verdict

    families = args.families or hf_zoo.causal_lm_types()
    verdicts = []
    print(HEADER, flush=True)
    if args.from_json:
        with open(args.from_json) as f:
            for d in json.load(f):
                d["diffs"] = {int(n): x for n, x in d["diffs"].items()}
                verdicts.append(Verdict(**d))
        families = []
    for family in families:
        v = verdict(family)
        verdicts.append(v)
        print(row(v), f"<!-- {v.seconds:.1f} s -->", flush=True)
    summary = counts(verdicts)
    print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(v) for v in verdicts], f, indent=1)
    if args.update_test:
        update_test(verdicts)
    if args.update_docs:
        update_docs(verdicts, summary)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(HEADER + "\n" + "\n".join(row(v) for v in verdicts) + "\n\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
