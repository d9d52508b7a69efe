"""The native CPU expert kernel's build: compiled once per machine by torch's JIT extension loader
from csrc/cpu_experts.cpp and its headers, into the user's cache directory."""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import platformdirs
import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_experts.cpp"
_CFLAGS = ["-O3", "-march=native"]


class NativeKernelError(RuntimeError):
    """The compiled CPU expert kernel cannot be built or loaded on this machine."""


def native_build_dir() -> Path:
    """Where the native kernel is built: the user cache dir, one folder per torch, Python and CPU.

    Code built with -march=native must never be loaded on another CPU, so the folder is keyed by the
    CPU's model and feature flags as well.
    """
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        cpu = "".join(re.findall(r"^(?:model name|flags|Features)\s*:.*$", cpuinfo, re.M)[:2])
    except OSError:
        cpu = platform.processor() + platform.machine()
    key = f"{torch.__version__}|{sys.version_info[:2]}|{cpu}"
    tag = hashlib.sha1(key.encode()).hexdigest()[:12]
    return Path(platformdirs.user_cache_dir("moelab")) / "torch_extensions" / f"cpu_experts-{tag}"


def load_native() -> ModuleType:
    """The compiled kernel module, built on first use; raises NativeKernelError saying why not."""
    result = _load_native_or_error(native_build_dir())
    if isinstance(result, NativeKernelError):
        raise result
    return result


@functools.cache
def _load_native_or_error(build_dir: Path) -> ModuleType | NativeKernelError:
    from torch.utils import cpp_extension

    # One module name per folder: torch's in-process versioner renames (and rebuilds) a module whose
    # name was last loaded from another folder.
    name = "moelab_cpu_experts_" + hashlib.sha1(str(build_dir).encode()).hexdigest()[:8]
    started_s = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob(f"{name}*.so")):
            log.info(
                "CPU experts: building the native kernel in %s (once per machine, ~20 s)", build_dir
            )
        module = cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as e:  # a compiler, ninja, file system or loader failure: no native kernel
        return NativeKernelError(
            f"the native CPU expert kernel could not be built in {build_dir}: {_build_error(e)}. "
            "It needs a C++ compiler (g++ >= 9) and ninja; kernel='torch' runs without them."
        )
    log.debug("CPU experts: native kernel loaded in %.1f s", time.perf_counter() - started_s)
    return module


def _build_error(e: Exception) -> str:
    """The line of a build failure that says what went wrong (the compiler's first error)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror\b", line, re.I) and not line.startswith("Error building extension"):
            return line
    return lines[-1] if lines else type(e).__name__
