"""The layout stays true: imports run one way, files stay small, public classes say why they exist."""

import ast
import os

import pytest
from helpers import ROOT

APP = os.path.join(ROOT, "app")

# Which parts each part may import (docs/architecture.md has the same table).
BASE = {"errors", "sink", "preflight"}  # import nothing of app; anyone may import them
ALLOWED = {
    "formats": {"formats"},
    "errors": {"errors"},
    "sink": {"sink"},
    "preflight": {"preflight"},
    "cache": {"cache", "formats"},
    "loader": {"loader", "formats", "cache"} | BASE,
    "sampler": {"sampler", "formats", "cache"} | BASE,
    "metrics": {"metrics", "loader", "sampler", "cache", "formats", "app"} | BASE,
}
FACE = {"app", "api", "config", "cli", "train", "run", "checkpoint", "stopping", "distributed", "demo", "bench"}  # may import anything
LONG_FILE = 400


def part_of(module: str) -> str:
    """``app.loader.pool`` -> ``loader``; ``app`` -> ``app``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "app"


def _is_module(root: str, dotted: str) -> bool:
    rel = os.path.join(os.path.dirname(root), *dotted.split("."))
    return os.path.exists(rel + ".py") or os.path.isdir(rel)


def imports_of(path: str, module: str, root: str = APP) -> list[tuple[int, str]]:
    """(line, imported app module) for every import in the file, function-level ones included."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name == "app" or a.name.startswith("app.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "app" or target.startswith("app."):
                # `from .. import x`: x is a module of that package, or a name defined in it
                names = [f"{target}.{a.name}" for a in node.names]
                out += [(node.lineno, n if _is_module(root, n) else target) for n in names]
    return out


def modules(root: str = APP) -> list[tuple[str, str]]:
    out = []
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                out.append((path, rel.removesuffix(".__init__")))
    return out


def violations(root: str = APP) -> list[str]:
    bad = []
    for path, module in modules(root):
        part = part_of(module)
        if part in FACE:
            continue
        for line, target in imports_of(path, module, root):
            to = part_of(target)
            if to not in ALLOWED[part]:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {part} imports {target} ({to})")
    return bad


def test_library_parts_import_only_in_the_allowed_direction():
    assert violations() == []


def test_the_direction_check_catches_a_library_part_reaching_up(tmp_path):
    (tmp_path / "app" / "loader").mkdir(parents=True)
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "loader" / "__init__.py").write_text("")
    (tmp_path / "app" / "loader" / "pool.py").write_text(
        "from ..metrics.sink import PrometheusSink\n"
        "def f():\n    from app.config import Config\n"
        "from ..sampler import fetch\n"
        "from .scheduler import Scheduler\n")
    found = violations(str(tmp_path / "app"))
    assert len(found) == 3
    assert any("metrics" in v for v in found) and any("config" in v for v in found)
    assert any("sampler" in v for v in found)


def test_every_library_part_is_in_the_table():
    parts = {part_of(m) for _, m in modules()}
    assert parts <= set(ALLOWED) | FACE, parts - set(ALLOWED) - FACE


@pytest.mark.parametrize("path, module", modules(), ids=[m for _, m in modules()])
def test_files_stay_small_or_say_why(path, module):
    lines = open(path).read().count("\n")
    if lines > LONG_FILE:
        doc = ast.get_docstring(ast.parse(open(path).read())) or ""
        assert "Why this file is long:" in doc, f"{module} has {lines} lines; split it or say why at its top"


@pytest.mark.parametrize("path, module", modules(), ids=[m for _, m in modules()])
def test_every_public_class_says_why_it_exists(path, module):
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            assert ast.get_docstring(node), f"{module}.{node.name} has no docstring"
