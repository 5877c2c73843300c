"""The layout stays true: imports run one way, the loader's stages too, no import circle, files stay small,
public classes say why they exist, and the package installs under its one name."""

import ast
import os
import tomllib

import pytest
from helpers import ROOT

APP = os.path.join(ROOT, "app")  # the source folder of the package `feedline`
PACKAGE = "feedline"

# Which parts each part may import (docs/architecture.md has the same table).
BASE = {"errors", "sink", "preflight", "procs"}  # import nothing of feedline; anyone may import them
ALLOWED = {
    "formats": {"formats"},
    "errors": {"errors"},
    "sink": {"sink"},
    "preflight": {"preflight"},
    "procs": {"procs"},
    "cache": {"cache", "formats"},
    "loader": {"loader", "formats", "cache"} | BASE,
    "sampler": {"sampler", "formats", "cache"} | BASE,
    "metrics": {"metrics", "loader", "sampler", "cache", "formats", PACKAGE} | BASE,
}
FACE = {PACKAGE, "__main__", "api", "appliance", "trainer", "demo", "bench", "report", "soak"}  # may import anything
# ... but within the face, one way too: the library's face knows neither the appliance, the demo trainer nor the
# tools; the demo trainer does not know the appliance that starts it, nor the tools.
FACE_BELOW = {"api": {"appliance", "trainer", "demo", "bench", "report", "soak"},
              "trainer": {"appliance", "demo", "bench", "report", "soak"}}

# Inside the loader, the stages in the order of the data flow (docs/architecture.md, "The loader's folders").
# A stage imports only the stages before it; everyone may import the loader's base modules; the loader's face
# (StagingLoader and what it wires) imports anything of the loader.
LOADER_BASE = {"errors", "stats", "watchdog", "cost"}  # import nothing else of the loader
LOADER_STAGES = {
    "cpus": set(),  # where the training process and its workers run (issue 69)
    "layout": set(),
    "plan": set(),
    "ring": {"layout"},
    "workers": {"layout", "plan", "ring", "cpus"},
    "device": {"layout", "ring", "workers"},
    "tune": {"workers", "cpus"},
    "remote": {"layout", "plan", "ring", "workers"},  # worker places decoded on a Ray cluster (issue 70)
}
LOADER_FACE = {"loader", "loader_epochs", "settings", "pipeline", "iterator", "__init__"}
LONG_FILE = 400


def part_of(module: str) -> str:
    """``feedline.loader.pool`` -> ``loader``; ``feedline`` -> ``feedline``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def stage_of(module: str) -> str | None:
    """``feedline.loader.workers.pool`` -> ``workers``; ``feedline.loader.stats`` -> ``stats``; None outside."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] != "loader":
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def _is_module(root: str, dotted: str) -> bool:
    rel = os.path.join(root, *dotted.split(".")[1:])
    return os.path.exists(rel + ".py") or os.path.isdir(rel)


def imports_of(path: str, module: str, root: str = APP) -> list[tuple[int, str]]:
    """(line, imported module of the package) for every import in the file, function-level ones included."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in (PACKAGE, "app")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] in (PACKAGE, "app"):
                # `from .. import x`: x is a module of that package, or a name defined in it
                names = [f"{target}.{a.name}" for a in node.names]
                out += [(node.lineno, n if _is_module(root, n) else target) for n in names]
    return out


def absolute_self_imports(path: str) -> list[int]:
    """Lines that import the package by a name (``feedline.`` or ``app.``): inside it, imports are relative."""
    tree = ast.parse(open(path).read(), path)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in (PACKAGE, "app") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in (PACKAGE,
                                                                                                          "app"):
            lines.append(node.lineno)
    return lines


def modules(root: str = APP) -> list[tuple[str, str]]:
    out = []
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out.append((path, f"{PACKAGE}.{rel}".removesuffix(".__init__")))
    return sorted(out)


def violations(root: str = APP) -> list[str]:
    bad = []
    for path, module in modules(root):
        part = part_of(module)
        if part in FACE:
            continue
        for line, target in imports_of(path, module, root):
            to = part_of(target)
            if to not in ALLOWED[part]:
                bad.append(f"{os.path.relpath(path, root)}:{line}: {part} imports {target} ({to})")
    return bad


def face_violations(root: str = APP) -> list[str]:
    bad = []
    for path, module in modules(root):
        part = part_of(module)
        for line, target in imports_of(path, module, root):
            if part_of(target) in FACE_BELOW.get(part, ()):
                bad.append(f"{os.path.relpath(path, root)}:{line}: {part} imports {target} ({part_of(target)})")
    return bad


def stage_violations(root: str = APP) -> list[str]:
    bad = []
    for path, module in modules(root):
        stage = stage_of(module)
        if stage is None or stage in LOADER_FACE:
            continue
        for line, target in imports_of(path, module, root):
            to = stage_of(target)
            if to is None or to == stage or to in LOADER_BASE:
                continue
            if stage in LOADER_BASE or to not in LOADER_STAGES[stage]:
                bad.append(f"{os.path.relpath(path, root)}:{line}: loader/{stage} imports {target} ({to})")
    return bad


def import_circles(root: str = APP) -> list[list[str]]:
    """Every strongly connected group of modules larger than one (Tarjan), function-level imports included:
    a circle a lazy import hides is still a circle."""
    graph: dict[str, set[str]] = {}
    for path, module in modules(root):
        graph[module] = {t for _, t in imports_of(path, module, root) if t != module}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package(tmp_path, files: dict[str, str]) -> str:
    root = tmp_path / "app"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def test_library_parts_import_only_in_the_allowed_direction():
    assert violations() == []


def test_the_direction_check_catches_a_library_part_reaching_up(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "loader/__init__.py": "",
        "loader/pool.py": "from ..metrics.sink import PrometheusSink\n"
                          "def f():\n    from feedline.api.config import Config\n"
                          "from ..sampler import fetch\n"
                          "from .scheduler import Scheduler\n"})
    found = violations(root)
    assert len(found) == 3
    assert any("metrics" in v for v in found) and any("config" in v for v in found)
    assert any("sampler" in v for v in found)


def test_the_face_imports_one_way_the_library_face_below_the_trainer_below_the_appliance():
    assert face_violations() == []


def test_the_face_check_catches_the_library_face_reaching_into_the_appliance(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "api/__init__.py": "", "trainer/__init__.py": "", "appliance/__init__.py": "",
        "api/config.py": "def f():\n    from ..appliance.cli import main\n",
        "trainer/train.py": "from ..api.config import Config\nfrom ..appliance import stopping\n",
        "appliance/cli.py": "from ..trainer.train import train\nfrom ..api.config import Config\n"})
    found = face_violations(root)
    assert len(found) == 2, found
    assert any("api imports" in v for v in found) and any("trainer imports" in v for v in found)


def test_every_library_part_is_in_the_table():
    parts = {part_of(m) for _, m in modules()}
    assert parts <= set(ALLOWED) | FACE, parts - set(ALLOWED) - FACE


def test_the_loaders_stages_import_only_the_stages_before_them():
    assert stage_violations() == []


def test_the_stage_check_catches_a_stage_reaching_downstream(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "loader/__init__.py": "", "loader/stats.py": "from .workers.messages import X\n",
        "loader/plan/__init__.py": "", "loader/plan/resume.py": "from ..ring.views import SlotView\n"
                                                                 "from ..errors import LoaderError\n",
        "loader/ring/__init__.py": "", "loader/ring/views.py": "def f():\n    from ..device import transfer\n",
        "loader/workers/__init__.py": "", "loader/workers/messages.py": "",
        "loader/device/__init__.py": "", "loader/device/transfer.py": "from ..ring.views import SlotView\n"})
    found = stage_violations(root)
    assert len(found) == 3, found
    assert any("loader/plan imports" in v for v in found) and any("loader/ring imports" in v for v in found)
    assert any("loader/stats imports" in v for v in found)


def test_every_loader_module_is_a_stage_a_base_module_or_the_face():
    stages = {stage_of(m) for _, m in modules()} - {None}
    assert stages <= set(LOADER_STAGES) | LOADER_BASE | LOADER_FACE, stages


def test_no_import_circle_anywhere_in_the_package():
    assert import_circles() == []


def test_the_circle_check_finds_a_circle_a_lazy_import_hides(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "from .b import x\n",
                               "b.py": "def f():\n    from . import c\n", "c.py": "import feedline.a\n"})
    assert import_circles(root) == [["feedline.a", "feedline.b", "feedline.c"]]


def test_imports_inside_the_package_are_relative_so_the_installed_name_is_the_only_name():
    bad = [f"{os.path.relpath(p, ROOT)}:{line}" for p, _ in modules() for line in absolute_self_imports(p)]
    assert bad == []


def test_pyproject_lists_every_package_of_the_source_folder_under_feedline():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    assert tool["package-dir"] == {PACKAGE: "app"}
    folders = sorted(m for p, m in modules() if p.endswith("__init__.py"))
    assert sorted(tool["packages"]) == folders


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
