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


# -- which compressor is this? ---------------------------------------------------------------
# The answer belongs in the compressor or in the registry (config/registry.py, the method's own
# config class). Counted outside compressors/ and outside the methods' config classes: an
# isinstance/type() test against a compressor or method-config class (the bases Compressor and
# MethodConfig only tell an object from a dict), and a comparison of a ``method`` (attribute, key
# or .get) or of a method's name with a literal.
MAX_KIND_BRANCHES = 10
METHOD_WORDS = {"none", "fp16", "topk", "randomk", "redsync", "iwp", "sbc", "powersgd", "signsgd", "qsgd",
                "threshold", "dcd", "ecd", "dpsgd", "naive", "radix"}


def _classes(folder: str, suffixes: tuple) -> dict:
    """{class name: [base names]} of the classes under ``folder`` whose names end with ``suffixes``."""
    out = {}
    for path in (REPO / "redsync_hvd" / folder).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(suffixes):
                out[node.name] = [getattr(b, "id", "") for b in node.bases]
    return out


def _method_configs() -> set:
    configs, found = {**_classes("config", ("Config",)), **_classes("compressors", ("Config",))}, {"MethodConfig"}
    while True:
        more = {n for n, bases in configs.items() if set(bases) & found} - found
        if not more:
            return found
        found |= more


def _is_method_ref(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "method") or \
        (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "method") or \
        (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
         and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "method")


def _words(node) -> set:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def _kind_test(node, kinds: set) -> str | None:
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") \
            and len(node.args) == 2:
        arg = node.args[1]
        names = {e.id for e in (arg.elts if isinstance(arg, ast.Tuple) else [arg]) if isinstance(e, ast.Name)}
        return f"isinstance {sorted(names & kinds)}" if names & kinds else None
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Call) and getattr(s.func, "id", None) == "type" for s in sides) \
                and any(getattr(s, "id", "") in kinds for s in sides):
            return "type() is"
        named = any(_is_method_ref(s) for s in sides) or any(_words(s) & {"iwp", "radix", "sbc"} for s in sides)
        if named and any(_words(s) & METHOD_WORDS for s in sides):
            return "compares a method's name"
    return None


def kind_branches() -> list:
    configs = _method_configs()
    kinds = (configs | set(_classes("compressors", ("Compressor",)))) - {"MethodConfig", "Compressor"}
    hits = []
    for path in sorted((REPO / "redsync_hvd").rglob("*.py")):
        if path.parent.name == "compressors":
            continue
        tree = ast.parse(path.read_text())
        own = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in configs for n in ast.walk(c)}
        for node in ast.walk(tree):
            why = None if id(node) in own else _kind_test(node, kinds)
            if why:
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}: {why}")
    return hits


def test_few_branches_ask_which_compressor_they_hold():
    hits = kind_branches()
    assert len(hits) <= MAX_KIND_BRANCHES, "move these answers into the compressor or the registry:\n" + "\n".join(hits)
    # the check sees what it counts: a branch of each kind, written here, is found
    probe = ast.parse("isinstance(c, RedSyncCompressor)\nif cfg.method == 'iwp': pass\ntype(c) is NoneConfig")
    assert sum(_kind_test(n, {"RedSyncCompressor", "NoneConfig"}) is not None for n in ast.walk(probe)) == 3


def test_the_compressor_contract_is_small():
    """GRACE's contract: at most 10 methods on ``Compressor`` besides its constructor."""
    tree = ast.parse((REPO / "redsync_hvd/compressors/base.py").read_text())
    base = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Compressor")
    methods = [n.name for n in base.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"]
    assert len(methods) <= 10, methods


def test_scripts_are_few_and_import_the_package():
    """scripts/ stays small (shared helpers live in redsync_hvd/experiments) and no script edits
    sys.path: the package is installed, so every script imports it as users do."""
    files = [p for p in (REPO / "scripts").rglob("*") if p.suffix in (".py", ".sh")]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert lines <= 4500, f"scripts/ has {lines} lines"
    edits = [str(p.relative_to(REPO)) for p in files if p.suffix == ".py" and "sys.path" in p.read_text()]
    assert not edits, edits
