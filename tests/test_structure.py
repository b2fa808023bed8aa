"""Project invariants: a flat hierarchy, a light import, a typed package."""

from __future__ import annotations

import ast
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
