"""The native CPU expert kernel's build: compiled by torch's JIT extension loader from
csrc/cpu_experts.cpp and its headers, once per source, into the user's cache directory.

A build folder is named by the hash of everything that makes the build: the .cpp and every header it
includes, the flags, torch, Python and the CPU (code built with -march=native must never run on
another CPU). Installs with one source therefore share a build, and a changed source gets a folder
of its own. A folder holds the finished module (renamed into place once built, so it is whole or
absent), `build.lock` and, while a build runs, its `build-PID/` staging folder.

Builds are serialised by flock(2) on `build.lock`: the kernel drops the lock when its holder exits,
however it exits, so a killed build never leaves a lock behind. The file names its holder's pid for
those who wait. A loaded module never takes the lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import platformdirs
import torch

log = logging.getLogger(__name__)

# The phases of a build that a loading engine reports (/health's `phase`)
COMPILING = "compiling the CPU kernel"
WAITING = "waiting for another build"
# called with a phase and, while waiting, the pid of the process that builds
BuildReport = Callable[[str, int | None], None]

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


class NativeKernelError(RuntimeError):
    """The compiled CPU expert kernel cannot be built or loaded on this machine."""


def extensions_dir() -> Path:
    """Where native builds are kept: the user's cache directory (XDG_CACHE_HOME on Linux)."""
    return Path(platformdirs.user_cache_dir("moelab")) / "torch_extensions"


def _cpu() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        return "".join(re.findall(r"^(?:model name|flags|Features)\s*:.*$", cpuinfo, re.M)[:2])
    except OSError:
        return platform.processor() + platform.machine()


@dataclass(frozen=True, slots=True)
class NativeExtension:
    """A C++ extension built from one source file (and the headers it includes) with flags."""

    label: str
    source: Path
    cflags: tuple[str, ...]

    def files(self) -> list[Path]:
        """The source and every header it includes with #include "...", each once, in order."""
        found: list[Path] = []
        pending = [self.source]
        while pending:
            path = pending.pop(0)
            if path in found:
                continue
            found.append(path)
            pending += [path.parent / name for name in _INCLUDE.findall(path.read_text())]
        return found

    def key(self) -> str:
        """The hash of what makes the build: the files' bytes, the flags, torch, Python, the CPU."""
        digest = hashlib.sha256()
        for path in self.files():
            name = path.relative_to(self.source.parent).as_posix()
            digest.update(f"{name}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
        build = [list(self.cflags), torch.__version__, list(sys.version_info[:2]), _cpu()]
        digest.update(json.dumps(build).encode())
        return digest.hexdigest()[:16]

    def build_dir(self, root: Path | None = None) -> Path:
        """This source's build folder under `root` (default: extensions_dir())."""
        return (root or extensions_dir()) / f"{self.label}-{self.key()}"

    def load(self, report: BuildReport | None = None, root: Path | None = None) -> ModuleType:
        """The compiled module, built first where no build of this source exists yet (or waited
        for, where another process builds it); raises NativeKernelError saying why not. `report`
        hears the build's phases (COMPILING, WAITING) as they begin."""
        build_dir = self.build_dir(root)
        with _loading:
            if build_dir not in _loaded:
                _loaded[build_dir] = self._load_or_error(build_dir, report or _unheard)
            result = _loaded[build_dir]
        if isinstance(result, NativeKernelError):
            raise result
        return result

    def _load_or_error(
        self, build_dir: Path, report: BuildReport
    ) -> ModuleType | NativeKernelError:
        # one module name per folder: torch's in-process versioner renames (and rebuilds) a module
        # whose name was last built in another folder
        name = f"moelab_{self.label}_" + hashlib.sha1(str(build_dir).encode()).hexdigest()[:8]
        built = build_dir / f"{name}.so"
        try:
            if built.is_file():
                return _import(name, built)
            build_dir.mkdir(parents=True, exist_ok=True)
            with BuildLock(build_dir / "build.lock", report):
                if built.is_file():  # built by the process this one waited for
                    return _import(name, built)
                return self._build(name, build_dir, report)
        except Exception as e:  # a compiler, ninja, file system or loader failure: no native kernel
            return NativeKernelError(
                f"the native CPU expert kernel could not be built in {build_dir}: "
                f"{_build_error(e).rstrip('.')}. It needs a C++ compiler (g++ >= 9) and ninja; "
                "kernel='torch' runs without them."
            )

    def _build(self, name: str, build_dir: Path, report: BuildReport) -> ModuleType:
        """Compiles the module in a staging folder of this process and renames it into place."""
        from torch.utils import cpp_extension

        for stale in build_dir.glob("build-*"):  # left by builds that ended before they finished
            shutil.rmtree(stale, ignore_errors=True)
        staging = build_dir / f"build-{os.getpid()}"
        staging.mkdir(exist_ok=True)
        log.info(
            "CPU experts: compiling the native kernel in %s (first start with this source, ~20 s)",
            build_dir,
        )
        report(COMPILING, None)
        started_s = time.perf_counter()
        module = cpp_extension.load(
            name=name,
            sources=[str(self.source)],
            extra_cflags=list(self.cflags),
            build_directory=str(staging),
            verbose=False,
        )
        os.replace(staging / f"{name}.so", build_dir / f"{name}.so")
        shutil.rmtree(staging, ignore_errors=True)
        log.info("CPU experts: native kernel compiled in %.1f s", time.perf_counter() - started_s)
        return module


class BuildLock:
    """An exclusive flock(2) on a build folder's lock file, naming its holder's pid for waiters.

    Entering waits while another process holds it, saying so (log and `report(WAITING, pid)`).
    """

    def __init__(self, path: Path, report: BuildReport | None = None) -> None:
        self.path = path
        self._report = report or _unheard
        self._fd: int | None = None

    def holder_pid(self) -> int | None:
        """The pid the lock file names (its holder's, while it is held), or None."""
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def __enter__(self) -> BuildLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self.holder_pid()
                log.info(
                    "CPU experts: waiting for another build of the native kernel in %s "
                    "(process %s holds %s)",
                    self.path.parent,
                    holder or "unknown",
                    self.path.name,
                )
                self._report(WAITING, holder)
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing drops the flock
        self._fd = None


def _unheard(phase: str, holder: int | None) -> None:
    pass


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# results per build folder, this process's: a failed build is not tried again
_loaded: dict[Path, ModuleType | NativeKernelError] = {}
_loading = threading.Lock()

# -ffp-contract=off: a * b + c is rounded twice wherever the source does not ask for an FMA, so
# that each code path rounds the same way for every weight type (left to itself, GCC fuses or not
# by its tuning for the CPU, which for AMD's avoids FMAs in some loops and not in others).
CPU_EXPERTS = NativeExtension(
    "cpu_experts",
    Path(__file__).parent / "csrc" / "cpu_experts.cpp",
    ("-O3", "-march=native", "-ffp-contract=off"),
)


def native_build_dir(root: Path | None = None) -> Path:
    """The CPU expert kernel's build folder (under `root`, default extensions_dir())."""
    return CPU_EXPERTS.build_dir(root)


def load_native(report: BuildReport | None = None) -> ModuleType:
    """The compiled CPU expert kernel, built on first use; raises NativeKernelError saying why not.
    `report` hears the build's phases when this call builds it or waits for another build."""
    return CPU_EXPERTS.load(report)


def _build_error(e: Exception) -> str:
    """The line of a build failure that says what went wrong (the compiler's first error)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror\b", line, re.I) and not line.startswith("Error building extension"):
            return line
    return lines[-1] if lines else type(e).__name__
