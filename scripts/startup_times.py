"""Engine construction times: cold (no prepacked bank), prepacked but not cached, and warm.

Usage: python scripts/startup_times.py CHECKPOINT_DIR  (prints one JSON line; docs/performance.md)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from moelab.engine.config.config import EngineConfig
from moelab.engine.runtime.engine import Engine


def drop_from_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def main() -> None:
    model = Path(sys.argv[1])
    bank = Path(tempfile.mkdtemp())
    config = EngineConfig.from_flags([
        "--model-path", str(model), "--bank-dir", str(bank), "--device-memory", "8GiB",
        "--kv-reserve-tokens", "4096", "--max-running-requests", "2", "--moe-cache-rate", "0.5",
    ])  # fmt: skip
    cases = {
        "cold (no prepacked bank, files not cached)": [model],
        "bank prepacked, files not cached": [model, bank],
        "warm (bank in the page cache)": [],
    }
    out = {}
    for label, folders in cases.items():
        for folder in folders:
            drop_from_page_cache(folder)
        t0 = time.perf_counter()
        Engine(config).close()
        out[label] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
