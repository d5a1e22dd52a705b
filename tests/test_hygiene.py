"""The code's own hygiene, enforced: style and complexity (ruff, ruff.toml), the layers and no
import circles (import-linter, .importlinter), short functions, and a project that speaks of
itself only."""
import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MAX_FUNCTION_LINES = 60


def _run(*cmd):
    return subprocess.run([str(c) for c in cmd], cwd=REPO, capture_output=True, text=True)


def test_ruff():
    res = _run(BIN / "ruff", "check", "redsync_hvd", "scripts", "tests")
    assert res.returncode == 0, res.stdout + res.stderr


def test_layers_and_no_import_circles():
    res = _run(BIN / "lint-imports", "--no-cache")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 kept, 0 broken" in res.stdout, res.stdout


def test_no_function_over_60_lines():
    long = []
    for path in sorted((REPO / "redsync_hvd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "split these functions:\n" + "\n".join(long)


def test_no_citation_of_documents_outside_the_repository():
    """Docs and comments cite papers and files of the repository, not notes, tickets or history."""
    pattern = re.compile(r"digest section|the digest|algorithms\.md|\bsession ?[0-9]|the issue'?s?\b|\bticket",
                         re.IGNORECASE)
    hits = []
    for folder in ("redsync_hvd", "scripts", "tests", "docs", "configs"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".py", ".md", ".yaml", ".sh") or "results" in path.parts:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "hexdigest" not in line and path.name != "test_hygiene.py":
                    hits.append(f"{path.relative_to(REPO)}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits[:30])
