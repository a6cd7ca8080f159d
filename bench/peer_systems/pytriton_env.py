"""A side environment in which PyTriton's server runs with numpy 1.

nvidia-pytriton 0.7 bundles a Triton server whose Python-backend stub reads numpy arrays
with numpy 1's memory layout: under numpy 2 every output tensor reaches the client empty
("cannot reshape array of size 0"). Only the server side needs numpy 1, so rather than
downgrade the whole virtualenv, the PyTriton peer runs in a small venv made here: numpy<2 of
its own, and everything else (torch, redbatch, pytriton itself) from the main virtualenv
through a ``.pth`` file read after its own packages. The stub runs Python from the
environment of the process that started Triton, so it gets this numpy too.

The stub also embeds libpython: the library path must put this interpreter's own libpython
before the system's (Debian's libpython3.11 is another build), and pytriton, finding itself
outside this venv's site-packages, looks for its bundled libraries in the wrong place, so
their folder goes on the path as well.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

#: Next to the main virtualenv, so it goes when that does.
ENV_DIR = Path(sys.prefix) / "pytriton-numpy1"
NUMPY_SPEC = "numpy>=1.21,<2"


def _site_packages(prefix: Path) -> Path:
    v = sys.version_info
    return prefix / "lib" / f"python{v.major}.{v.minor}" / "site-packages"


def python() -> Path:
    """The side environment's interpreter, made on first use (one pip install of numpy)."""
    exe = ENV_DIR / "bin" / "python"
    marker = _site_packages(ENV_DIR) / "zz_main_venv.pth"
    if exe.exists() and marker.exists():
        return exe
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip",  # type: ignore[attr-defined]
                    str(ENV_DIR)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target",
                    str(_site_packages(ENV_DIR)), NUMPY_SPEC], check=True)
    main_site = [p for p in site.getsitepackages() if p.endswith("site-packages")][0]
    # An "import" line in a .pth runs: addsitedir also reads the main venv's own .pth files
    # (the editable install of redbatch), and appends, so numpy 1 here stays first.
    marker.write_text(f"import site; site.addsitedir({main_site!r})\n")
    return exe


def library_path() -> str:
    """LD_LIBRARY_PATH for the server: this interpreter's libpython first, then pytriton's
    bundled libraries, then whatever was there."""
    import pytriton

    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    parts = [sysconfig.get_config_var("LIBDIR") or "", str(libs),
             os.environ.get("LD_LIBRARY_PATH", "")]
    return os.pathsep.join(p for p in parts if p)
