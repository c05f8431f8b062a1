"""Faster float32 on a Linux CPU: run MLX's matmuls on OpenBLAS instead of reference BLAS.

The ``mlx-cpu`` wheel ships netlib's reference BLAS, and MLX sends every
float32 matmul to BLAS. Debian's ``libopenblas0-pthread`` exports the same
symbols (``cblas_sgemm`` ...), so preloading it (``LD_PRELOAD``) before MLX is
loaded makes float32 decode 2-3x faster and big matmuls ~30x faster, with no
change to MLX. A library cannot be preloaded into a running process, so
``mlxd serve`` re-executes itself once, with the same command line, when:

- the platform is Linux, ``--blas`` / ``MLXD_BLAS`` is ``auto`` (default) or
  ``openblas``, and
- an OpenBLAS is found (``MLXD_BLAS_LIBRARY``, else the usual distribution
  paths) that exports ``cblas_sgemm``, and
- it is not already preloaded (``LD_PRELOAD``) or active (``MLXD_BLAS_ACTIVE``).

``openblas`` makes a missing library an error; ``off`` never preloads. The
re-executed process keeps its PID, so supervisors and ``/proc`` see one server.
Install the library with ``apt-get install libopenblas0-pthread`` (``make setup``
does it when it runs as root). ``OPENBLAS_NUM_THREADS`` limits its threads.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

MODES = ("auto", "openblas", "off")
ENV_MODE = "MLXD_BLAS"
ENV_LIBRARY = "MLXD_BLAS_LIBRARY"
ENV_ACTIVE = "MLXD_BLAS_ACTIVE"
INSTALL_HINT = "apt-get install libopenblas0-pthread (Debian/Ubuntu)"

Action = Literal["none", "preload", "error"]


def candidate_paths(machine: str | None = None) -> list[Path]:
    """Where distributions put OpenBLAS (pthread build first: OpenMP fights MLX's threads)."""
    arch = machine or platform.machine()
    multiarch = f"/usr/lib/{arch}-linux-gnu"
    return [Path(p) for p in (
        f"{multiarch}/openblas-pthread/libopenblas.so.0",
        f"{multiarch}/libopenblas.so.0",
        "/usr/lib64/libopenblasp.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
    )]


def exports_sgemm(path: Path) -> bool:
    """True when ``path`` loads and exports ``cblas_sgemm`` (the symbol MLX calls)."""
    try:
        return hasattr(ctypes.CDLL(str(path), mode=os.RTLD_LOCAL), "cblas_sgemm")
    except OSError:
        return False


def find_openblas(environ: Mapping[str, str], paths: Sequence[Path] | None = None) -> Path | None:
    """The OpenBLAS to preload: ``MLXD_BLAS_LIBRARY`` if set, else the first usable candidate."""
    explicit = environ.get(ENV_LIBRARY)
    options = [Path(explicit)] if explicit else list(paths or candidate_paths())
    for path in options:
        if path.exists() and exports_sgemm(path):
            return path
    return None


@dataclass(frozen=True)
class BlasPlan:
    """What to do about BLAS before serving: nothing, preload ``library``, or fail."""

    action: Action
    reason: str
    library: Path | None = None


def plan_blas(mode: str | None, environ: Mapping[str, str], system: str = sys.platform,
              paths: Sequence[Path] | None = None) -> BlasPlan:
    """Decide from the mode (flag, else ``MLXD_BLAS``, else ``auto``) and the environment."""
    mode = (mode or environ.get(ENV_MODE) or "auto").lower()
    if mode not in MODES:
        return BlasPlan("error", f"unknown BLAS mode {mode!r}: use one of {', '.join(MODES)}")
    if mode == "off":
        return BlasPlan("none", "OpenBLAS preload disabled (--blas off)")
    if not system.startswith("linux"):
        return BlasPlan("none", "not Linux: MLX uses the platform's own BLAS")
    if environ.get(ENV_ACTIVE):
        return BlasPlan("none", f"OpenBLAS preloaded from {environ[ENV_ACTIVE]}",
                        Path(environ[ENV_ACTIVE]))
    preloaded = [p for p in environ.get("LD_PRELOAD", "").replace(":", " ").split()
                 if "openblas" in Path(p).name]
    if preloaded:
        return BlasPlan("none", f"OpenBLAS already in LD_PRELOAD ({preloaded[0]})",
                        Path(preloaded[0]))
    library = find_openblas(environ, paths)
    if library is not None:
        return BlasPlan("preload", f"preloading OpenBLAS from {library}", library)
    if mode == "openblas":
        return BlasPlan("error", f"--blas openblas: no OpenBLAS found; install it: {INSTALL_HINT}"
                                 f" or set {ENV_LIBRARY}")
    return BlasPlan("none", f"reference BLAS (float32 is 2-3x faster with {INSTALL_HINT})")


def preload_env(environ: Mapping[str, str], library: Path) -> dict[str, str]:
    """``environ`` with ``library`` first in ``LD_PRELOAD`` and the re-exec marker set."""
    env = dict(environ)
    env["LD_PRELOAD"] = " ".join([str(library), *env.get("LD_PRELOAD", "").split()])
    env[ENV_ACTIVE] = str(library)
    return env


def launched_as_serve(argv: Sequence[str]) -> bool:
    """True when this process is ``mlxd serve`` itself (so re-executing it is safe), not a
    test runner or another program that called ``serve.run`` in-process."""
    if not argv:
        return False
    name = Path(argv[0]).name
    if name == "serve.py":
        return True
    return name in ("mlxd", "__main__.py") and len(argv) > 1 and argv[1] == "serve"


def reexec_with_openblas(mode: str | None) -> BlasPlan:
    """Apply ``plan_blas``: re-execute the process with OpenBLAS preloaded (does not return)
    when that is the plan and safe, else return the plan so the caller can report it."""
    plan = plan_blas(mode, os.environ)
    if plan.action != "preload" or plan.library is None:
        return plan
    if not launched_as_serve(sys.argv):
        return BlasPlan("none", "OpenBLAS found but not preloaded: mlxd is running inside "
                                "another program (set LD_PRELOAD yourself)", plan.library)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), preload_env(os.environ, plan.library))
    raise AssertionError("unreachable")  # pragma: no cover


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def sgemm_provider() -> str | None:
    """The file of the library whose ``cblas_sgemm`` this process's global symbol lookup
    finds first: the one MLX's CPU matmuls call (its own reference BLAS, or a preloaded
    one). None where it cannot be told (no such symbol loaded, or no ``dladdr``).

    A library merely loaded is not enough: numpy's bundled OpenBLAS, for one, exports
    its functions under other names and never serves MLX."""
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p).value
        dladdr = process.dladdr
    except (OSError, AttributeError):
        return None
    info = _DlInfo()
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not address or not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) \
            or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


# Optimised BLAS builds, by library file name: a matmul over a few rows costs about one
# row's there, as on a GPU (the reference BLAS of the mlx-cpu wheel is several times slower).
FAST_BLAS_NAMES = ("openblas", "mkl", "blis", "accelerate")


def fast_sgemm() -> bool:
    """Whether MLX's float32 matmuls run on an optimised BLAS in this process."""
    provider = sgemm_provider()
    return provider is not None and any(n in Path(provider).name.lower()
                                        for n in FAST_BLAS_NAMES)
