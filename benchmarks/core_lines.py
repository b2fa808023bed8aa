"""Lines of the core (lib/stratagem without testing/ and cli/): code, docstrings, comments, blanks.

Run: ``python -m benchmarks.core_lines`` (``--files`` lists every module). Docstrings are
the string statements that open a module, class or function; comments are lines holding
only a comment.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "lib" / "stratagem"
LEFT_OUT = ("testing", "cli")


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                end = body[0].end_lineno or body[0].lineno
                lines.update(range(body[0].lineno, end + 1))
    return lines


def count(path: Path) -> dict[str, int]:
    """Split one module's lines into code, docstrings, comments and blanks."""
    text = path.read_text()
    docstrings = _docstring_lines(ast.parse(text))
    comment_only: set[int] = set()
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            comment_only.add(token.start[0])
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    result = {"code": 0, "docstrings": 0, "comments": 0, "blanks": 0}
    for number, line in enumerate(text.splitlines(), start=1):
        if number in docstrings:
            result["docstrings"] += 1
        elif number in code_lines:
            result["code"] += 1
        elif number in comment_only:
            result["comments"] += 1
        elif not line.strip():
            result["blanks"] += 1
        else:  # a line inside a multi-line string that is not a docstring
            result["code"] += 1
    return result


def core_modules() -> list[Path]:
    """Every module of the core, sorted."""
    return sorted(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in LEFT_OUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="one line per module")
    args = parser.parse_args()
    total = {"code": 0, "docstrings": 0, "comments": 0, "blanks": 0}
    modules = core_modules()
    for path in modules:
        counts = count(path)
        for key, value in counts.items():
            total[key] += value
        if args.files:
            print(f"{sum(counts.values()):6} {counts['code']:6}  {path.relative_to(ROOT)}")
    lines = sum(total.values())
    print(
        f"core: {len(modules)} modules, {lines} lines: {total['code']} code, "
        f"{total['docstrings']} docstrings, {total['comments']} comments, {total['blanks']} blanks"
    )


if __name__ == "__main__":
    main()
