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


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)  # no headings in code
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.M)
    }


def test_readme_and_docs_links_and_pictures_resolve():
    """Every relative link and picture in README.md and docs/*.md points at a file that exists,
    and at a heading of it when it names one; a committed picture stays small."""
    broken = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
            elif dest.suffix == ".png":
                assert dest.stat().st_size < 150_000, f"{dest} is {dest.stat().st_size} bytes"
    assert not broken, broken
