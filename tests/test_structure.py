"""Project invariants: a flat hierarchy, a light import, a typed package."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

import stratagem

LIB = Path(stratagem.__file__).parent
ALLOWED_BASES = {"Protocol", "Generic"}


def _is_exception(name: str) -> bool:
    builtin = getattr(__import__("builtins"), name, None)
    if isinstance(builtin, type) and issubclass(builtin, BaseException):
        return True
    errors = vars(__import__("stratagem.errors", fromlist=["x"]))
    local = errors.get(name)
    return isinstance(local, type) and issubclass(local, BaseException)


def test_no_class_in_lib_subclasses_anything_but_protocol_or_an_exception():
    offenders = []
    files = sorted(LIB.rglob("*.py"))
    assert len(files) > 5
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    name = ast.unparse(base).split(".")[-1].split("[")[0]
                    if name not in ALLOWED_BASES and not _is_exception(name):
                        offenders.append(
                            f"{path.relative_to(LIB)}:{node.lineno} {node.name}({name})"
                        )
    assert offenders == []


def test_the_walk_would_catch_a_subclass(tmp_path):
    # Guard against a walk that finds nothing: the same rule applied to a bad sample.
    tree = ast.parse("class DDP(ParallelStrategy):\n    pass\n")
    [cls] = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    assert ast.unparse(cls.bases[0]) not in ALLOWED_BASES and not _is_exception("ParallelStrategy")


def test_import_pulls_in_neither_hypothesis_nor_pytest():
    # Every public name is touched, so the lazy re-exports load every module they name. (This
    # once listed 'numpy.testing' and 'torch._dynamo' among first components, so it could not
    # see either: they are dotted names, matched whole now.)
    code = (
        "import sys, json, stratagem; [getattr(stratagem, n) for n in stratagem.__all__]; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('hypothesis', 'pytest', '_pytest') or m.startswith('numpy.testing'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# torch submodules that `import torch` does not load and that take a long time to import (DCP
# alone about half a second): the first checkpoint, compile, FSDP or pipeline pays for them.
HEAVY = (
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
)


def test_every_public_name_loads_no_heavy_torch_submodule_until_it_is_used():
    # A background-save module once imported DCP for every user of single_device().
    code = (
        f"import sys, json, torch; heavy = {HEAVY!r}; before = set(sys.modules); "
        "import stratagem; [getattr(stratagem, n) for n in stratagem.__all__]; "
        "print(json.dumps(sorted(m for m in set(sys.modules) - before "
        "if any(m == h or m.startswith(h + '.') for h in heavy))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_import_alone_loads_no_submodule():
    code = "import sys, json, stratagem; print(json.dumps(sorted(m for m in sys.modules if m.startswith('stratagem.'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_lazy_exports_agree_with_the_imports_type_checkers_read():
    tree = ast.parse((LIB / "__init__.py").read_text())
    [guard] = [n for n in tree.body if isinstance(n, ast.If)]
    typed = {
        alias.asname: node.module
        for node in guard.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == stratagem._WHERE
    assert sorted(stratagem.__all__) == sorted(typed)


def test_package_is_typed():
    assert (LIB / "py.typed").exists()


def test_public_names_are_all_exported():
    for name in stratagem.__all__:
        assert getattr(stratagem, name) is not None
        assert name in dir(stratagem)
    public = {
        name
        for name, value in vars(stratagem).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(stratagem.__all__) == public


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_strategy"):
        stratagem.no_such_strategy  # noqa: B018


def test_subpackages_are_reachable_as_attributes_in_a_fresh_process():
    # A resume script's first line may be sg.checkpoint.latest(...): nothing else loaded yet.
    code = (
        "import stratagem as sg; "
        "print(sg.checkpoint.latest.__module__, sg.testing.World.__name__, "
        "sg.combinators.checked.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["stratagem.checkpoint.directory", "World", "checked"]


# Built-in factories whose device defaults to "auto": CUDA on a GPU host, the CPU elsewhere.
AUTO_DEVICE_FACTORIES = {
    "single_device",
    "ddp",
    "ddp_spawn",
    "fsdp",
    "fsdp_spawn",
    "hsdp",
    "allreduce_grads",
    "allreduce_grads_spawn",
    "pipeline",
}
TESTS = Path(__file__).parent
# What "auto" does is these files' subject: the device policy's, and the kit's, whose laws run
# on whatever device a strategy resolves to (issue 33 item 3).
DEVICE_IS_THE_SUBJECT = ("test_device_policy.py", "test_kit_*.py")


def factory_calls_without_a_device(source: str) -> list[int]:
    """Return the lines that call a built-in factory without naming its device."""
    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stratagem")
        for alias in node.names
        if alias.name in AUTO_DEVICE_FACTORIES
    }
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            name = func.attr if func.value.id in ("sg", "stratagem") else None
        else:
            name = imported.get(func.id) if isinstance(func, ast.Name) else None
        if name not in AUTO_DEVICE_FACTORIES:
            continue
        named = {keyword.arg for keyword in node.keywords}
        if "device" in named or None in named or (name == "single_device" and node.args):
            continue
        lines.append(node.lineno)
    return lines


def test_tests_name_the_device_their_strategies_run_on():
    # A test that leaves device="auto" runs on CUDA and NCCL on a GPU host (or on the CPU with a
    # DeviceFallbackWarning, an error under filterwarnings, on a one-GPU host): the suite would
    # depend on the host. Write device="cpu" where the test means the CPU, or mark it cuda.
    exempt = {path for pattern in DEVICE_IS_THE_SUBJECT for path in TESTS.glob(pattern)}
    files = sorted(set(TESTS.rglob("*.py")) - exempt)
    assert len(files) > 20
    offenders = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in files
        for line in factory_calls_without_a_device(path.read_text())
    ]
    assert offenders == [], "name the device (device='cpu'): " + ", ".join(offenders)


def test_the_scan_would_catch_a_strategy_left_on_auto():
    source = (
        "import stratagem as sg\nfrom stratagem import ddp_spawn as spawned_ddp\n"
        "a = sg.ddp_spawn(timeout=60)\nb = spawned_ddp()\nc = sg.single_device()\n"
        "d = sg.ddp(device='cpu')\ne = sg.single_device('cpu')\nf = sg.fsdp(**options)\n"
        "g = sg.dp()\n"
    )
    assert factory_calls_without_a_device(source) == [3, 4, 5]


def test_tests_import_their_helpers_as_ci_runs_them():
    # CI runs plain `pytest`, whose rootdir-relative imports know `helpers`, not a `tests`
    # package: `from tests.helpers import ...` passed under `python -m pytest` and failed CI.
    offenders = [
        f"{path.name}:{node.lineno}"
        for path in sorted(TESTS.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests"
    ]
    assert offenders == []


def test_the_built_in_factories_named_for_error_messages_are_the_public_ones():
    # strategy.py names them itself: reading them off the package would import upwards.
    from stratagem.strategy import BUILT_IN_FACTORIES

    public = {
        name
        for name in stratagem.__all__
        if stratagem._WHERE[name].startswith("stratagem.strategies.")  # ddp_spawn: a SpawnVariant
        and inspect.signature(getattr(stratagem, name)).return_annotation == "Strategy"
    }
    assert public == BUILT_IN_FACTORIES


def _room(module: str) -> str | None:
    """The top-level module or subpackage of lib/stratagem that ``module`` is in."""
    parts = module.split(".")
    if parts[0] != "stratagem":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imported(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    module = ".".join([*base, *([node.module] if node.module else [])])
    found = []
    for alias in node.names:  # `from stratagem import checkpoint` imports a submodule, not __init__
        path = LIB.joinpath(*f"{module}.{alias.name}".split(".")[1:])
        is_module = path.with_suffix(".py").exists() or (path / "__init__.py").exists()
        found.append(f"{module}.{alias.name}" if is_module else module)
    return found


def import_floors() -> tuple[dict[str, set[str]], dict[str, int]]:
    """Rooms (top-level modules and subpackages) and their imports, and each room's floor.

    Every import statement counts, at the top, inside a function or under TYPE_CHECKING.
    A room's floor is one above the highest room it imports; a circle is an error.
    """
    edges: dict[str, set[str]] = {}
    for path in LIB.rglob("*.py"):
        parts = path.relative_to(LIB).with_suffix("").parts
        module = ".".join(("stratagem", *parts)).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        room = _room(module)
        assert room is not None
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported(node, package):
                target = _room(name)
                if target is not None and target != room:
                    edges.setdefault(room, set()).add(target)
    floors: dict[str, int] = {}

    def floor(room: str, below: tuple[str, ...] = ()) -> int:
        assert room not in below, f"an import circle: {' -> '.join((*below, room))}"
        if room not in floors:
            floors[room] = 1 + max(
                (floor(t, (*below, room)) for t in edges.get(room, ())), default=0
            )
        return floors[room]

    for room in list(edges):
        floor(room)
    return edges, floors


def test_the_import_graph_has_no_circle_and_at_most_ten_floors():
    # Issue 36: 16 floors before, from a launcher's constant, an exception class and a message
    # helper kept above what needed them, and the CLI importing the whole package.
    edges, floors = import_floors()
    top = max(floors, key=floors.__getitem__)
    assert floors[top] <= 10, f"{floors[top]} floors, from {top}: {sorted(floors.items())}"
    assert floors["errors"] == 1
    assert "__init__" not in {target for targets in edges.values() for target in targets}


def test_the_floor_count_would_catch_an_import_that_runs_back_up(tmp_path, monkeypatch):
    fake = tmp_path / "stratagem"
    for name, text in {
        "__init__.py": "",
        "errors.py": "import stratagem.top\n",
        "top.py": "from stratagem import errors\n",
    }.items():
        (fake / name).parent.mkdir(exist_ok=True)
        (fake / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "LIB", fake)
    with pytest.raises(AssertionError, match="an import circle"):
        import_floors()
