"""How an engine process ended, in words, and whether the kernel's out-of-memory killer ended it.

A SIGKILL says nothing about who sent it: the OOM killer, a user's `kill -9`, a supervisor's
timeout. Out of memory is said only on evidence: the OOM kills the kernel counts in the process's
memory cgroup (`oom_kill` in cgroup v2's memory.events or v1's memory.oom_control) rose while it
ran, or the kernel's log names its pid. Torch-free: the manager and the benchmark read it.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ..text import Text

CGROUP_ROOT = Path("/sys/fs/cgroup")
KERNEL_LOG = Path("/dev/kmsg")
_MAX_KERNEL_RECORDS = 200_000


def exit_words(code: int) -> Text:
    """An exit status (Popen's: a signal is negative) as it follows "the engine": "exited with
    code 1", "was killed by signal 9 (SIGKILL)"."""
    if code >= 0:
        return Text("exited with code {code}", code=code)
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return Text("was killed by signal {signal}", signal=-code)
    return Text("was killed by signal {signal} ({name})", signal=-code, name=name)


@dataclass(frozen=True, slots=True)
class OomWatch:
    """The OOM kills counted in a process's memory cgroup when it was started, to compare with
    the count once it has ended."""

    pid: int
    counter: Path | None
    count_at_start: int | None
    since_s: float  # CLOCK_MONOTONIC, the kernel log's clock: older reports name another process

    @classmethod
    def start(cls, pid: int) -> OomWatch:
        """Read the count of `pid`'s cgroup now (call it right after starting the process)."""
        counter = memory_counter(pid)
        since_s = time.clock_gettime(time.CLOCK_MONOTONIC) - 1.0
        return cls(pid, counter, read_oom_kills(counter) if counter else None, since_s)

    def evidence(self) -> Text | None:
        """Why the OOM killer is known to have ended the process, or None when nothing says so."""
        if self.counter is not None and self.count_at_start is not None:
            now = read_oom_kills(self.counter)
            if now is not None and now > self.count_at_start:
                return Text(
                    "the kernel's OOM killer ended it (oom_kill in {counter} went from {before} "
                    "to {now})",
                    counter=str(self.counter),
                    before=self.count_at_start,
                    now=now,
                )
        report = kernel_oom_report(self.pid, self.since_s)
        return Text("the kernel's log says: {report}", report=report) if report else None


def memory_counter(pid: int, root: Path = CGROUP_ROOT) -> Path | None:
    """The file in which the kernel counts OOM kills for `pid`'s memory cgroup, if readable."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # cgroup v2 (alone, or the "unified" mount of a hybrid)
            for v2_root in (root, root / "unified"):
                candidates.append(v2_root / relative / "memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / relative / "memory.oom_control")
    for candidate in candidates:
        if read_oom_kills(candidate) is not None:
            return candidate
    return None


def read_oom_kills(counter: Path) -> int | None:
    """The `oom_kill` count of a memory.events or memory.oom_control file."""
    try:
        for line in counter.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def kernel_oom_report(pid: int, since_s: float, log: Path = KERNEL_LOG) -> str | None:
    """The kernel log's report, since `since_s`, that the OOM killer killed `pid` (where the log
    can be read: /dev/kmsg needs root or kernel.dmesg_restrict=0)."""
    try:
        fd = os.open(log, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    killed = f"Killed process {pid} ("
    found = None
    try:
        for _ in range(_MAX_KERNEL_RECORDS):
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break  # the end of the log
            except OSError as err:
                if err.errno == errno.EPIPE:
                    continue  # a record overwritten while reading: go on with the next
                break
            # "priority,sequence,microseconds since boot,flags;message"
            fields, _, message = record.partition(";")
            stamp = fields.split(",")
            if killed in message and len(stamp) > 2 and int(stamp[2]) / 1e6 >= since_s:
                found = message.strip()
    finally:
        os.close(fd)
    return found
