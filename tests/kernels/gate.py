"""A gate that holds a CPU expert runner's workers, so that a test decides when queued jobs run."""

from __future__ import annotations

import threading

import torch

from moelab.kernels.cpu_experts import CpuExpertRunner


class Gate:
    """Holds a runner's workers (each of the native pool's, or the torch kernel's one thread)
    until `open()`: the jobs submitted meanwhile queue behind it, so that the test decides when
    they run rather than racing them. After limit_s the gate gives up by itself (`opened()`
    then says False): only a test whose other thread never got to open it waits that long."""

    def __init__(self, runner: CpuExpertRunner, limit_s: float = 60.0) -> None:
        self._word = torch.zeros(1, dtype=torch.int64)
        self._state = self._word.numpy()  # read and written without letting go of the GIL
        self._opened = threading.Event()
        if runner.kernel == "native":
            # a worker takes one gate's one task and stays in it: one gate for each worker
            for _ in range(runner.num_threads):
                runner._module.submit_gate(runner._pool, self._word.data_ptr(), limit_s, False)
        else:

            def hold() -> None:
                if not self._opened.wait(limit_s):
                    self._state[0] = -1

            runner._executor.submit(hold)

    def open(self) -> None:
        self._state[0] = 1
        self._opened.set()

    def opened(self) -> bool:
        """Whether `open()` let the workers go (False: the gate gave up, or is still closed)."""
        return bool(self._state[0] == 1)
