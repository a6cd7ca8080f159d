"""The folders are the architecture: imports run down the data path, never back up it.

Drawn from the code with ast, so a new back-arrow fails here the day it is written:

    cli             the top floor: may import every package
    producer        common
    gpu_worker      common, handlers, preproc_worker
    preproc_worker  common, handlers
    handlers        common
    common          nothing else
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "cli": {"common", "producer", "handlers", "preproc_worker", "gpu_worker"},
    "producer": {"common"},
    "gpu_worker": {"common", "handlers", "preproc_worker"},
    "preproc_worker": {"common", "handlers"},
    "handlers": {"common"},
    "common": set(),
}
#: Past this many lines a module says in its docstring why it is not split.
LONG_MODULE_LINES = 400


def modules(package: str) -> Iterator[Path]:
    yield from sorted((ROOT / package).rglob("*.py"))


def imported_packages(path: Path) -> set[str]:
    """The redbatch packages a module imports anywhere (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "redbatch" and len(parts) > 1 and parts[1] in ALLOWED:
                found.add(parts[1])
    return found


def test_every_package_folder_is_known() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(ALLOWED), "a new package needs its row in ALLOWED (and the README)"


def test_imports_run_down_the_data_path_only() -> None:
    back = [f"{path.relative_to(ROOT)} imports redbatch.{other}"
            for package, allowed in ALLOWED.items() for path in modules(package)
            for other in imported_packages(path) - allowed - {package}]
    assert not back, back


def test_the_rules_themselves_have_no_cycle() -> None:
    seen: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, f"cycle: {' -> '.join((*path, package))}"
        for other in ALLOWED[package]:
            visit(other, (*path, package))
        seen.add(package)

    for package in ALLOWED:
        visit(package, ())
    assert seen == set(ALLOWED)


def test_long_modules_say_why() -> None:
    unexplained = []
    for package in ALLOWED:
        for path in modules(package):
            lines = len(path.read_text().splitlines())
            docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
            if lines > LONG_MODULE_LINES and "lines" not in docstring:
                unexplained.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not unexplained, ("say in the docstring why it is this long, or split it",
                             unexplained)
