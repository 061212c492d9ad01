"""The docs' CPU examples run: every ```bash cpu-example block in docs/*.md and README.md, from the
repo root, with `set -e`; and the module map in docs/architecture.md names files that exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
FENCE = re.compile(r"^```bash cpu-example[^\n]*\n(.*?)^```", re.M | re.S)


def cpu_examples() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        if doc.is_file():
            for i, m in enumerate(FENCE.finditer(doc.read_text())):
                out.append((f"{doc.name}#{i}", m.group(1)))
    return out


EXAMPLES = cpu_examples()


def test_docs_have_cpu_examples():
    names = {name.split("#")[0] for name, _ in EXAMPLES}
    assert "launching.md" in names


@pytest.mark.parametrize(("name", "script"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_cpu_example_runs(name, script):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # No pipefail: examples pipe into `head`, which closes the pipe early by design.
    r = subprocess.run(
        ["bash", "-e", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, (
        f"{name} failed:\n{script}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    )
    assert r.stdout.strip(), f"{name} printed nothing"


def test_architecture_module_map_names_real_files():
    text = (REPO / "docs" / "architecture.md").read_text()
    paths = re.findall(r"`(megatron_dapo/[\w/.]+)`", text)
    assert len(paths) > 40
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_docs_link_to_each_other():
    for doc in (REPO / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([\w./-]+\.md)\)", doc.read_text()):
            assert (doc.parent / target).is_file(), f"{doc.name} links to missing {target}"
