"""Processes for the native build's tests: a loader of the tiny test extension that prints each
build phase it hears, and a process that holds a build folder's lock until its stdin closes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TINY_SOURCE = Path(__file__).parent / "data" / "tiny_extension" / "tiny.cpp"

_LOADER = """
import json, sys
from pathlib import Path
from moelab.kernels.native_build import NativeExtension

source, root = Path(sys.argv[1]), Path(sys.argv[2])
extension = NativeExtension("tiny", source, ("-O0",))
module = extension.load(lambda phase, holder: print(json.dumps([phase, holder]), flush=True), root)
print(json.dumps(["loaded", module.answer()]), flush=True)
"""

_HOLDER = """
import sys
from pathlib import Path
from moelab.kernels.native_build import BuildLock

path = Path(sys.argv[1])
path.parent.mkdir(parents=True, exist_ok=True)
with BuildLock(path):
    print("held", flush=True)
    sys.stdin.read()
"""


def start_loader(
    source: Path, root: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """A process loading the extension of `source` from (or building it into) `root`, in a
    session of its own; each line it prints is JSON: [phase, holder pid] then ["loaded", answer]."""
    return subprocess.Popen(
        [sys.executable, "-c", _LOADER, str(source), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def read_lines(process: subprocess.Popen[str], timeout_s: float = 300) -> list[list]:
    """Everything the loader prints until it exits (the timeout only stops a hung test)."""
    out, err = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def hold_build_lock(lock_path: Path) -> subprocess.Popen[str]:
    """A live process holding `lock_path` (kernels/native_build.BuildLock) until its stdin
    closes; returns once it holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(lock_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline() == "held\n"
    return holder


def release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(timeout=60)


def fake_compiler(path: Path, script: str) -> dict[str, str]:
    """An environment whose C++ compiler is the shell `script` written at `path`."""
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return {**os.environ, "CXX": str(path), "TORCH_DONT_CHECK_COMPILER_ABI": "1"}
