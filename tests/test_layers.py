"""The layers of docs/design.md, read from the source: imports point down, the schedules know
no torch, and no module outside the engine imports a private name from it."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "deepsolve"

# what each package of the library may import from deepsolve (itself always)
ALLOWED = {
    "schedules": set(),
    "engine": {"schedules"},
    "physics": set(),
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        yield rel, ast.parse(path.read_text(), filename=str(path))


def _imports(rel: pathlib.Path, tree: ast.AST):
    """(absolute module name, imported names, node) of every import in ``tree``."""
    package = ["deepsolve", *rel.parts[:-1]]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names], node


def _top(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if parts[0] == "deepsolve" and len(parts) > 1 else None


def test_the_module_scan_sees_the_library():
    names = {str(rel) for rel, _ in _modules()}
    assert {"engine/interpreter.py", "schedules/revolve.py", "unroll.py"} <= names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_lower_layer_imports_nothing_above_it(package):
    bad = []
    for rel, tree in _modules():
        if rel.parts[0] != package:
            continue
        for mod, _, node in _imports(rel, tree):
            top = _top(mod)
            if top is not None and top != package and top not in ALLOWED[package]:
                bad.append(f"{rel}:{node.lineno} imports {mod}")
    assert not bad, "; ".join(bad)


def test_the_schedules_are_pure_python():
    bad = [f"{rel}:{node.lineno} imports {mod}" for rel, tree in _modules()
           if rel.parts[0] == "schedules"
           for mod, _, node in _imports(rel, tree) if mod.split(".")[0] == "torch"]
    assert not bad, "; ".join(bad)


def test_no_private_name_is_imported_from_the_engine_outside_it():
    bad = []
    for rel, tree in _modules():
        if rel.parts[0] == "engine":
            continue
        for mod, names, node in _imports(rel, tree):
            if _top(mod) == "engine":
                private = [n for n in names if n.startswith("_")] + \
                    [p for p in mod.split(".")[2:] if p.startswith("_")]
                if private:
                    bad.append(f"{rel}:{node.lineno} imports {', '.join(private)} from {mod}")
    assert not bad, "; ".join(bad)


def test_every_engine_module_is_reexported():
    import deepsolve.engine as engine

    for rel, tree in _modules():
        if rel.parts[0] != "engine" or rel.name == "__init__.py":
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                for name in ast.literal_eval(node.value):
                    assert name in engine.__all__, f"{rel}: {name} is not in deepsolve.engine"


# the domain decomposition's building blocks know torch.distributed, not the trainer: a
# physics code imports them without layer 5 (distributed/data.py is the trainer's part)
ALLOWED_FILES = {
    "distributed/halo.py": set(),
    "distributed/mesh.py": set(),
    "distributed/domain.py": {"deepsolve.distributed.halo"},
    "memory/agree.py": {"deepsolve.memory.profiling"},
}


@pytest.mark.parametrize("path", sorted(ALLOWED_FILES))
def test_the_decomposition_blocks_import_no_layer_above_them(path):
    tree = next(t for rel, t in _modules() if str(rel) == path)
    used = {mod for mod, _, _ in _imports(pathlib.Path(path), tree) if _top(mod) is not None}
    assert used <= ALLOWED_FILES[path], f"{path} imports {sorted(used - ALLOWED_FILES[path])}"


# every top-level module or package of deepsolve/ by its floor (docs/design.md): a module
# imports only from floors below its own (the package root, which re-exports the public
# names, sits on top; _version and _process are leaves anyone may use)
FLOORS = [
    {"_version", "_process", "schedules", "physics", "stability", "artefacts"},
    {"engine"},
    {"memory"},
    {"settings"},
    {"unroll", "sequential", "reversible"},
    {"fixed_point", "gradcheck", "pinn"},
    {"io"},
    {"problem"},
    {"distributed"},
    {"config"},
    {"training"},
    {"train", "slurm"},
    {"cli"},
    {"__main__", "__init__"},
]
FLOOR = {name: k for k, names in enumerate(FLOORS) for name in names}

# the training package's modules in their order: each imports only those before it
TRAINING = ["progress", "signals", "rng", "restart_check", "restart", "rundir", "rows", "terms",
            "prepare", "check", "stopping", "start", "run", "__init__"]


def _target(mod: str, names: list[str]) -> list[str]:
    """The top-level deepsolve modules an import reaches (``from deepsolve import x``
    reaches ``x`` where ``x`` is a module)."""
    top = _top(mod)
    if top is not None:
        return [top]
    if mod == "deepsolve":
        return [n for n in names if n in FLOOR] or ["__init__"]
    return []


def test_every_module_has_a_floor():
    tops = {rel.parts[0].removesuffix(".py") for rel, _ in _modules()}
    assert tops == set(FLOOR), (sorted(tops - set(FLOOR)), sorted(set(FLOOR) - tops))


def test_no_import_points_up_or_sideways():
    bad = []
    for rel, tree in _modules():
        here = rel.parts[0].removesuffix(".py")
        for mod, names, node in _imports(rel, tree):
            for there in _target(mod, names):
                if there != here and FLOOR[there] >= FLOOR[here]:
                    bad.append(f"{rel}:{node.lineno} imports {mod} (floor {FLOOR[there]} from "
                               f"floor {FLOOR[here]})")
    assert not bad, "; ".join(bad)


# the log package's modules in their order
LOG = ["files", "schema", "read", "write", "__init__"]


@pytest.mark.parametrize("package, order", [(("training",), TRAINING), (("io", "log"), LOG)],
                         ids=["training", "io/log"])
def test_the_modules_of_a_package_import_only_those_before_them(package, order):
    n = len(package)
    names = {rel.stem for rel, _ in _modules()
             if rel.parts[:n] == package and len(rel.parts) == n + 1}
    assert names == set(order), sorted(names ^ set(order))
    bad = []
    for rel, tree in _modules():
        if rel.parts[:n] != package:
            continue
        for mod, _, node in _imports(rel, tree):
            parts = mod.split(".")
            if parts[1:n + 1] == list(package) and len(parts) > n + 1:
                if order.index(parts[n + 1]) >= order.index(rel.stem):
                    bad.append(f"{rel}:{node.lineno} imports {mod}")
    assert not bad, "; ".join(bad)


def test_no_private_function_takes_more_than_eight_parameters():
    bad = []
    for rel, tree in _modules():
        if rel.parts[0] not in ("training", "io"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.name.startswith("_") and not node.name.startswith("__"):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - \
                    (1 if a.args and a.args[0].arg in ("self", "cls") else 0)
                if n > 8:
                    bad.append(f"{rel}:{node.lineno} {node.name} takes {n}")
    assert not bad, "; ".join(bad)


def test_each_module_of_the_training_floor_is_under_500_lines():
    floor = [rel for rel, _ in _modules()
             if rel.parts[0] == "training" or rel.parts[:2] == ("io", "log")]
    assert len(floor) >= 14, floor
    lines = {rel: len(PKG.joinpath(rel).read_text().splitlines()) for rel in floor}
    long = [f"{rel} ({n} lines)" for rel, n in lines.items() if n >= 500]
    assert not long, long


def test_what_the_trainer_writes_to_is_a_log():
    from deepsolve.io.log import H5Log, Log
    from deepsolve.io.tracking import MirroredLog
    from deepsolve.training.run import NoLog

    assert isinstance(NoLog(), Log)
    for cls in (H5Log, MirroredLog):
        assert all(callable(getattr(cls, m, None)) for m in
                   ("append", "append_curve", "flush", "truncate_after", "close")), cls
        assert hasattr(cls, "columns"), cls
