"""The native kernel's build: one folder per source, a build killed midway or a live builder never
blocks a later start for good, and a waiter says whom it waits for.

These build a tiny extension (tests/kernels/data/tiny_extension, about a second) in processes of
their own, not the CPU expert kernel."""

from __future__ import annotations

import platform
import shutil
import signal
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from moelab.kernels.native_build import (
    COMPILING,
    CPU_EXPERTS,
    WAITING,
    BuildLock,
    NativeExtension,
)

from .native_build_procs import (
    TINY_SOURCE,
    fake_compiler,
    hold_build_lock,
    read_lines,
    release,
    start_loader,
)


def checkout(tmp_path: Path, name: str) -> Path:
    """A copy of the tiny extension's source tree, as another checkout of the project holds it."""
    tree = tmp_path / name / "csrc"
    shutil.copytree(TINY_SOURCE.parent, tree)
    return tree / TINY_SOURCE.name


def tiny(source: Path = TINY_SOURCE) -> NativeExtension:
    return NativeExtension("tiny", source, ("-O0",))


def test_a_build_killed_midway_does_not_stop_the_next_start(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    # a compiler that kills the build it runs in (the loader's whole process group, as a closed
    # terminal would), leaving the build folder as a first start interrupted mid-build leaves it
    killing = fake_compiler(tmp_path / "c++", "set -- $(cat /proc/$$/stat)\nkill -9 -$6\n")
    first = start_loader(TINY_SOURCE, root, env=killing)
    first.communicate(timeout=300)
    assert first.returncode == -signal.SIGKILL
    build_dir = tiny().build_dir(root)
    assert BuildLock(build_dir / "build.lock").holder_pid() == first.pid  # a dead process's
    assert list(build_dir.glob("*/lock")), "torch's own lock file was not left behind"

    lines = read_lines(start_loader(TINY_SOURCE, root))
    assert lines == [[COMPILING, None], ["loaded", 42]]


def test_a_live_builder_is_waited_for_and_named(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    holder = hold_build_lock(tiny().build_dir(root) / "build.lock")
    try:
        waiter = start_loader(TINY_SOURCE, root)
        assert waiter.stdout is not None
        assert waiter.stdout.readline() == f'["{WAITING}", {holder.pid}]\n'
    finally:
        release(holder)
    assert read_lines(waiter) == [[COMPILING, None], ["loaded", 42]]


def test_one_source_is_built_once_for_every_checkout(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first, second = checkout(tmp_path, "a"), checkout(tmp_path, "b")
    assert tiny(first).build_dir(root) == tiny(second).build_dir(root)

    assert read_lines(start_loader(first, root)) == [[COMPILING, None], ["loaded", 42]]
    assert read_lines(start_loader(second, root)) == [["loaded", 42]]  # no build


def test_a_changed_header_or_flag_gets_a_build_of_its_own(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    source = checkout(tmp_path, "a")
    changed = checkout(tmp_path, "changed")
    header = changed.parent / "answer.h"
    header.write_text(header.read_text().replace("42", "43"))
    folders = {
        tiny(source).build_dir(root),
        tiny(changed).build_dir(root),
        NativeExtension("tiny", source, ("-O1",)).build_dir(root),
    }
    assert len(folders) == 3

    assert read_lines(start_loader(source, root)) == [[COMPILING, None], ["loaded", 42]]
    assert read_lines(start_loader(changed, root)) == [[COMPILING, None], ["loaded", 43]]


def test_the_cpu_expert_kernels_key_covers_every_header() -> None:
    csrc = CPU_EXPERTS.source.parent
    assert {p.name for p in CPU_EXPERTS.files()} == {p.name for p in csrc.glob("*.[ch]*")}


def test_a_failing_build_ends_with_the_compilers_error(tmp_path: Path) -> None:
    env = fake_compiler(
        tmp_path / "c++", "echo 'tiny.cpp:1:1: error: simulated compiler failure' >&2\nexit 1\n"
    )
    loader = start_loader(TINY_SOURCE, tmp_path / "cache", env=env)
    out, err = loader.communicate(timeout=300)
    assert loader.returncode == 1
    assert out.splitlines() == [f'["{COMPILING}", null]']
    assert "simulated compiler failure" in err and "could not be built" in err


@pytest.mark.parametrize("arch", ["x86-64", "x86-64-v3"], ids=["no-simd", "avx2"])
def test_the_cpu_expert_kernel_compiles_for_cpus_without_avx512_or_avx2(arch: str) -> None:
    """-march=native builds on the machine that runs it, so a path guarded by one SIMD level's
    macro can break the build of another: the source passes the compiler's checks for the x86-64
    baseline (no AVX2, as a build on another architecture sees it) and for AVX2 without AVX-512."""
    compiler = shutil.which("g++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs g++ on x86-64")
    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    done = subprocess.run(
        [compiler, "-std=c++17", "-fsyntax-only", f"-march={arch}",
         *(f"-I{p}" for p in includes), str(CPU_EXPERTS.source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
