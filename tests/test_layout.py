"""The folders are the architecture: imports run down the data path, never back up it.

Drawn from the code with ast, so a new back-arrow fails here the day it is written:

    cli             the top floor: may import every package
    scoring         common, producer (the bulk program is a user of the client)
    gateway         common, producer (the HTTP gateway is a user of the client)
    producer        common
    gpu_worker      common, handlers, preproc_worker
    preproc_worker  common, handlers
    handlers        common
    common          nothing else

Inside gpu_worker/ the rooms go by concern, and the floor on top of them (loop, startup,
worker, threads, events, outbox) may use every room:

    streams/        Redis I/O; may use metrics
    batching/       pure policy; nothing else of the worker (no redis, no torch)
    device/         torch; only the profile's records from tuning/ (Variant)
    tuning/         calibration; may use device/
    generation/     continuous batching of a generative model (scheduler, KV blocks, model,
                    engine): torch, never redis, nothing else of the worker
    generating/     the generation worker: generation/ driven by streams/ (and start-up's
                    connections, device/'s watchdog), in threads
    metrics.py      a leaf every room may use
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "cli": {"common", "producer", "scoring", "handlers", "preproc_worker", "gpu_worker",
            "gateway"},
    "gateway": {"common", "producer"},
    "scoring": {"common", "producer"},
    "producer": {"common"},
    "gpu_worker": {"common", "handlers", "preproc_worker"},
    "preproc_worker": {"common", "handlers"},
    "handlers": {"common"},
    "common": set(),
}
#: What each room of gpu_worker/ may import of the worker (its own modules aside): rooms, or
#: single modules by their dotted name under gpu_worker.
ROOMS = {
    "streams": {"metrics"},
    "batching": set(),
    "device": {"tuning.profile"},
    "tuning": {"device", "tuning"},
    "generation": set(),
    "generating": {"generation", "streams", "metrics", "startup", "device.watchdog"},
}
#: Third-party imports a room must never make.
FORBIDDEN = {"batching": {"redis", "torch"}, "device": {"redis"}, "streams": {"torch"},
             "generation": {"redis"}}
#: Past this many lines of code (not blank, not comments, not docstrings) a module says why it
#: is not split, in the first line of its docstring, with the words "long because".
LONG_MODULE_LINES = 400
#: A module past this many lines in all (its prose counted) is reported by the test of size.
LONG_FILE_LINES = 600


def modules(package: str) -> Iterator[Path]:
    yield from sorted((ROOT / package).rglob("*.py"))


def imported_names(path: Path) -> Iterator[str]:
    """Every module name a module imports anywhere (inside functions too)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            if node.module.startswith("redbatch."):  # from redbatch.x import module
                yield from (f"{node.module}.{a.name}" for a in node.names)


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
    assert packages == set(ALLOWED), "a new package needs its row in ALLOWED (and docs/layout.md)"


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


def code_lines(source: str) -> int:
    """The lines that hold code: blank lines, comments and docstrings do not count."""
    tree = ast.parse(source)
    prose: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                prose.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - prose)


def test_code_lines_counts_code_only() -> None:
    source = '"""A docstring\nsaying lines.\n"""\n# a comment\n\nx = 1\n\n\ndef f() -> str:\n' \
        '    """Doc."""\n    return """a\nstring"""\n'
    assert code_lines(source) == 4  # x = 1, def, and the two lines of the returned string


def test_long_modules_say_why() -> None:
    unexplained = []
    for package in ALLOWED:
        for path in modules(package):
            source = path.read_text()
            lines, total = code_lines(source), len(source.splitlines())
            first = (ast.get_docstring(ast.parse(source)) or "").split("\n", 1)[0]
            if (lines > LONG_MODULE_LINES or total > LONG_FILE_LINES) \
                    and "long because" not in first:
                unexplained.append(f"{path.relative_to(ROOT)}: {lines} code lines, {total} in all")
    assert not unexplained, ("say in the docstring's first line why it is this long "
                             "('long because ...'), or split it", unexplained)


def worker_imports(path: Path) -> set[str]:
    """The gpu_worker modules a module imports, as dotted names under gpu_worker."""
    prefix = "redbatch.gpu_worker."
    return {name[len(prefix):] for name in imported_names(path) if name.startswith(prefix)
            and (ROOT / "gpu_worker" / (name[len(prefix):].replace(".", "/") + ".py")).exists()}


def test_every_room_of_the_worker_is_known() -> None:
    rooms = {p.parent.name for p in (ROOT / "gpu_worker").glob("*/__init__.py")}
    assert rooms == set(ROOMS), "a new room needs its row in ROOMS (and this docstring)"


def test_the_rooms_import_only_what_their_concern_allows() -> None:
    wrong = []
    for room, allowed in ROOMS.items():
        for path in modules(f"gpu_worker/{room}"):
            for name in worker_imports(path):
                if name.split(".")[0] not in allowed | {room} and name not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports gpu_worker.{name}")
            third = {n.split(".")[0] for n in imported_names(path)} & FORBIDDEN.get(room, set())
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in sorted(third)]
    assert not wrong, wrong


def test_the_metrics_leaf_imports_no_room() -> None:
    assert worker_imports(ROOT / "gpu_worker" / "metrics.py") == set()
