"""Writes docs/api.md, the API reference, from the docstrings of unbubble's public modules.

Usage (from the repository root, with unbubble installed):

    python docs/gen_api.py            # rewrites docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is not what the code gives

Walks every module of the ``unbubble`` package except the command line (``unbubble.cli``: see
``unbubble COMMAND --help``) and private modules (a name part starting with ``_``). In a git checkout
only tracked files are documented. A module's public names are its ``__all__``, else every name not
starting with ``_`` that the module itself defines. Classes list their public methods and properties.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"


def _tracked() -> set[str] | None:
    try:
        out = subprocess.run(["git", "ls-files", "src/unbubble"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    names = set()
    for line in out.stdout.splitlines():
        if line.endswith(".py"):
            mod = line[len("src/"):-3].replace("/", ".")
            names.add(mod[: -len(".__init__")] if mod.endswith(".__init__") else mod)
    return names or None


def modules() -> list[str]:
    import unbubble

    tracked = _tracked()
    names = ["unbubble"]
    for info in pkgutil.walk_packages(unbubble.__path__, "unbubble."):
        parts = info.name.split(".")
        if parts[1] == "cli" or any(p.startswith("_") for p in parts):
            continue
        if tracked is not None and info.name not in tracked:
            continue
        names.append(info.name)
    return sorted(names)


def _signature(obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    # a default computed from the checkout's location reads relative to it, not as this machine's path
    return sig.replace("'", "").replace(f"{ROOT}/", "")


def _doc(obj) -> str:
    doc = inspect.getdoc(obj) or "*(no docstring)*"
    return doc.strip()


def _block(doc: str) -> list[str]:
    """A docstring in markdown: its first paragraph as text, the rest (Args, Returns, code) verbatim."""
    first, _, rest = doc.partition("\n\n")
    lines = first.splitlines()
    if rest.strip():
        lines += ["", "```text", *rest.splitlines(), "```"]
    return lines


def public_names(module) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_"):
            continue
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == module.__name__:
            out.append(name)
    return out


def document_module(name: str) -> list[str]:
    module = importlib.import_module(name)
    lines = [f"## `{name}`", ""]
    lines += _block((inspect.getdoc(module) or "*(no module docstring)*").strip())
    lines.append("")
    if hasattr(module, "__path__"):  # a package: its names are documented where they are defined
        exported = []
        for attr in public_names(module):
            obj = getattr(module, attr, None)
            home = getattr(obj, "__module__", None)
            if home and home != name and home.startswith("unbubble"):
                exported.append(f"[`{attr}`](#{home.replace('.', '')})")
        if exported:
            lines += ["Re-exports: " + ", ".join(exported) + ".", ""]
            return lines
    for attr in public_names(module):
        obj = getattr(module, attr, None)
        if obj is None or not (inspect.isclass(obj) or callable(obj)):
            continue
        if inspect.isclass(obj):
            lines += [f"### class `{attr}{_signature(obj)}`", ""] + _block(_doc(obj)) + [""]
            for mname, member in inspect.getmembers(obj):
                if mname.startswith("_") or mname not in obj.__dict__:
                    continue
                if isinstance(member, property) or isinstance(obj.__dict__[mname], property):
                    lines += [f"- property `{attr}.{mname}`: " + (inspect.getdoc(obj.__dict__[mname]) or "").split("\n\n")[0]
                              .replace("\n", " ")]
                elif inspect.isfunction(member) or inspect.ismethod(member):
                    lines += ["", f"#### `{attr}.{mname}{_signature(member)}`", ""] + _block(_doc(member))
            lines.append("")
        else:
            lines += [f"### `{attr}{_signature(obj)}`", ""] + _block(_doc(obj)) + [""]
    return lines


def render() -> str:
    names = modules()
    head = ["# API reference", "",
            "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand. Terms (N, k, v, Δ, τ) "
            "are defined in [concepts.md](concepts.md); the command line is documented by `unbubble COMMAND --help`.",
            "", "Modules:", ""]
    head += [f"- [`{n}`](#{n.replace('.', '')})" for n in names]
    body: list[str] = []
    for n in names:
        body += [""] + document_module(n)
    return "\n".join(head + body).rstrip() + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    args = p.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python docs/gen_api.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines, {len(modules())} modules)")


if __name__ == "__main__":
    main()
