"""The worker image installs redbatch the way CI does, from every folder the package needs.

CI (.ci/run -> scripts/test.sh -> scripts/setup.sh) installs torch first, then the package
with extras; the image installs the same torch version first (from PyPI its Linux wheel is
built for CUDA), then the package with the same extras less `test`. No Docker engine runs
here, so the files are read, not built.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib

from deploy_files import ROOT, load_compose, service_env

EXTRAS = re.compile(r"""["']?\.\[([a-z0-9_,-]+)\]["']?""")


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def pyproject() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def package_installs(commands: list[str]) -> list[set[str]]:
    """Extras of each `pip install` of the package itself (`.[a,b]`) in shell commands."""
    return [set(m.group(1).split(",")) for c in commands if "pip install" in c
            for m in EXTRAS.finditer(c)]


def ci_install_commands() -> list[str]:
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup.sh" in (ROOT / "scripts" / "test.sh").read_text()
    return [ln for ln in (ROOT / "scripts" / "setup.sh").read_text().splitlines()
            if "pip install" in ln and not ln.lstrip().startswith("#")]


def test_image_installs_the_package_as_ci_does() -> None:
    ci = ci_install_commands()
    torch_first = [i for i, c in enumerate(ci) if re.search(r"""["' ]torch==""", c)]
    (ci_extras,) = package_installs(ci)
    assert torch_first and torch_first[0] < next(i for i, c in enumerate(ci) if ".[" in c)

    runs = [args for op, args in dockerfile() if op == "RUN"]
    (image_extras,) = package_installs(runs)
    assert image_extras == ci_extras - {"test"} and "worker" in image_extras
    # torch first, the very version the tests run (issue 15: the image ran 2.5.1).
    image_torch = [i for i, r in enumerate(runs) if "pip install" in r and TORCH.search(r)]
    assert image_torch and image_torch[0] < next(i for i, r in enumerate(runs) if ".[" in r)
    assert TORCH.findall(runs[image_torch[0]]) == [ci_torch_pin()]


TORCH = re.compile(r"""["' ]torch==([\d.]+)""")


def ci_torch_pin() -> str:
    (pin,) = {v for c in ci_install_commands() for v in TORCH.findall(c)}
    return pin


def test_base_image_is_pinned_python_and_the_torch_pin_is_in_the_packages_range() -> None:
    (base,) = [args for op, args in dockerfile() if op == "FROM"]
    repo, tag = base.split(":")
    assert repo == "python" and tag.startswith("3.11.") and "latest" not in tag
    (req,) = [r for r in pyproject()["project"]["optional-dependencies"]["worker"]
              if re.match(r"torch\b", r)]
    minimum = re.fullmatch(r"torch>=([\d.]+)", req.replace(" ", ""))
    assert minimum, f"update this check for the requirement {req!r}"
    version = tuple(int(p) for p in ci_torch_pin().split("."))
    assert version >= tuple(int(p) for p in minimum.group(1).split("."))


def test_the_python_claimed_is_the_one_the_image_runs_and_the_code_needs() -> None:
    """requires-python and the classifiers start at the image's Python, 3.11: the code
    needs it (typing.Self, enum.StrEnum), so claiming 3.10 promised an install that fails
    at import."""
    (base,) = [args for op, args in dockerfile() if op == "FROM"]
    image = tuple(int(p) for p in base.split(":")[1].split("-")[0].split(".")[:2])
    project = pyproject()["project"]
    assert project["requires-python"] == f">={image[0]}.{image[1]}"
    claimed = sorted(tuple(int(p) for p in c.rsplit(" ", 1)[1].split("."))
                     for c in project["classifiers"]
                     if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert claimed and claimed[0] == image, claimed


def copied_paths() -> set[str]:
    """Checkout paths the Dockerfile COPYs (sources of each COPY, normalised)."""
    paths = set()
    for op, args in dockerfile():
        if op == "COPY":
            *sources, _ = shlex.split(args)
            paths |= {s.rstrip("/").removeprefix("./") for s in sources if not s.startswith("--")}
    return paths


def test_image_copies_everything_the_package_build_reads() -> None:
    meta = pyproject()
    setuptools = meta["tool"]["setuptools"]
    root = setuptools["package-dir"]["redbatch"]
    needed = {"pyproject.toml", meta["project"]["readme"], "__init__.py"}
    # The license files the metadata names: setuptools refuses a build missing one.
    needed |= set(meta["project"]["license-files"])
    # A sub-package (gpu_worker.tuning) comes with its top-level folder.
    needed |= {p.split(".")[1] for p in setuptools["packages"] if "." in p}
    # Package data by its top folder (samples/*.jpg comes with `COPY samples`).
    needed |= {entry.split("/")[0] for entry in setuptools.get("package-data", {})
               .get("redbatch", [])}
    assert root == "." and needed <= copied_paths()
    install = next(i for i, (op, a) in enumerate(dockerfile()) if op == "RUN" and ".[" in a)
    last_copy = max(i for i, (op, _) in enumerate(dockerfile()) if op == "COPY")
    assert last_copy < install


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip().rstrip("/") for ln in lines
            if ln.strip() and not ln.startswith(("#", "!"))]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether a path or a folder above it matches a .dockerignore pattern."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.removeprefix("**/"))
               for p in prefixes for pat in patterns)


def test_dockerignore_keeps_local_state_out_and_the_sources_in() -> None:
    patterns = dockerignore_patterns()
    for local in (".git", ".venv", "build", "tests", "common/__pycache__"):
        assert ignored(local, patterns), local
    data = pyproject()["tool"]["setuptools"].get("package-data", {}).get("redbatch", [])
    for path in copied_paths():
        files = [path] if (ROOT / path).is_file() else [
            str(f.relative_to(ROOT)) for f in (ROOT / path).rglob("*")
            if f.suffix == ".py" or any(fnmatch.fnmatch(str(f.relative_to(ROOT)), d)
                                        for d in data)]
        for f in files:
            assert not ignored(f, patterns), f"{f} is copied but .dockerignore drops it"


def test_image_runs_the_compose_worker() -> None:
    instructions = dockerfile()
    (cmd,) = [a for op, a in instructions if op == "CMD"]
    worker = load_compose()["services"]["worker"]
    assert json.loads(cmd) == worker["command"]
    exposed = {p for op, a in instructions if op == "EXPOSE" for p in a.split()}
    assert service_env(worker)["REDBATCH_METRICS_PORT"] in exposed
    assert ("STOPSIGNAL", "SIGTERM") in instructions and ("USER", "redbatch") in instructions
