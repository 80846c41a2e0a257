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


def test_api_reference_generator_documents_the_public_modules():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    for heading in ("## `unbubble.pipeline`", "### `split_sequential(", "### class `StageBuilder(",
                    "## `unbubble.config`", "### `load_config(", "## `unbubble.optim.basis_rotation`"):
        assert heading in text
    assert "unbubble.cli" not in re.findall(r"^## `([^`]+)`", text, flags=re.M)
