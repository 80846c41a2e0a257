"""Writes docs/api.md, the API reference of unbubble's public names (``unbubble.__all__``).

Usage (from the repository root, with unbubble installed):

    python docs/gen_api.py            # rewrites docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is not what the code gives

Documents each name of ``unbubble.__all__`` from its docstring, with its home module: a function's
signature, a class's public methods and properties, a public module's ``__all__``. Everything else is
internal (docs/architecture.md, "Public API") and documented in its module's docstring; the command
line by ``unbubble COMMAND --help``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"


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


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.strip().replace(" ", "-")


def _heading(name: str, obj) -> str:
    return f"`unbubble.{name}` (module)" if isinstance(obj, types.ModuleType) else f"`unbubble.{name}`"


def _function(title: str, obj) -> list[str]:
    return [f"### `{title}{_signature(obj)}`", ""] + _block(_doc(obj)) + [""]


def _class(title: str, obj) -> list[str]:
    lines = [f"### class `{title}{_signature(obj)}`", ""] + _block(_doc(obj)) + [""]
    for mname, member in inspect.getmembers(obj):
        if mname.startswith("_") or mname not in obj.__dict__:
            continue
        if isinstance(obj.__dict__[mname], property):
            first = (inspect.getdoc(obj.__dict__[mname]) or "").split("\n\n")[0].replace("\n", " ")
            lines += [f"- property `{obj.__name__}.{mname}`: " + first]
        elif inspect.isfunction(member) or inspect.ismethod(member):
            lines += ["", f"#### `{obj.__name__}.{mname}{_signature(member)}`", ""] + _block(_doc(member))
    return lines + [""]


def document(name: str) -> list[str]:
    """One public name of ``unbubble``: its heading, where it is defined, its docstring."""
    import unbubble

    obj = getattr(unbubble, name)
    if isinstance(obj, types.ModuleType):
        lines = [f"## {_heading(name, obj)}", ""] + _block(_doc(obj)) + [""]
        for attr in obj.__all__:
            lines += document_object(f"unbubble.{name}.{attr}", getattr(obj, attr))
        return lines
    lines = [f"## {_heading(name, obj)}", "", f"Defined in `{obj.__module__}`.", ""]
    return lines + document_object(f"unbubble.{name}", obj)


def document_object(title: str, obj) -> list[str]:
    return _class(title, obj) if inspect.isclass(obj) else _function(title, obj)


def render() -> str:
    import unbubble

    head = ["# API reference", "",
            "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand. These are the public "
            "names, `unbubble.__all__`; everything else is internal and documented in its module's docstring "
            "([architecture.md](architecture.md#public-api)). Terms (N, k, v, Δ, τ) are defined in "
            "[concepts.md](concepts.md); the command line is documented by `unbubble COMMAND --help`.", ""]
    head += _block(_doc(unbubble)) + ["", "Names:", ""]
    for n in unbubble.__all__:
        heading = _heading(n, getattr(unbubble, n))
        head.append(f"- [{heading}](#{_anchor(heading)})")
    body: list[str] = []
    for n in unbubble.__all__:
        body += [""] + document(n)
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
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
