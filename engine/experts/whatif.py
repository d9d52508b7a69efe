"""The cache what-if curve: the hit rate every cache size would have had on the recent accesses.

One pass of LRU stack distances (Mattson) gives every size at once: an access hits in an LRU cache
of S slots exactly when fewer than S distinct keys were accessed since its key's previous access.
A Fenwick tree over access times counts those keys in O(log n). The loop runs in a small C file
(engine/csrc/stack_distance.c) compiled once per machine and called through ctypes; without a C
compiler the same algorithm runs in Python.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

import numpy as np

log = logging.getLogger("moelab.whatif")

_SOURCE = Path(__file__).parent / "csrc" / "stack_distance.c"


class _State(ctypes.Structure):
    _fields_ = [
        ("cap", ctypes.c_int64), ("now", ctypes.c_int64), ("num_keys", ctypes.c_int64),
        ("window", ctypes.c_int64), ("seen", ctypes.c_int64),
        ("tree", ctypes.c_void_p), ("last", ctypes.c_void_p), ("ring", ctypes.c_void_p),
        ("hist", ctypes.c_void_p), ("order", ctypes.c_void_p),
    ]  # fmt: skip


def _compiled_library() -> ctypes.CDLL | None:
    import platformdirs

    source = _SOURCE.read_bytes()
    out_dir = Path(platformdirs.user_cache_dir("moelab")) / "native"
    lib = out_dir / f"stack_distance-{hashlib.sha1(source).hexdigest()[:12]}.so"
    if not lib.is_file():
        compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if compiler is None:
            return None
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".tmp{id(lib)}")
        result = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", str(_SOURCE), "-o", str(tmp)],
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            log.warning("what-if: C build failed, using Python: %s", result.stderr.strip()[-300:])
            return None
        tmp.replace(lib)
    dll = ctypes.CDLL(str(lib))
    dll.sd_add.argtypes = [ctypes.POINTER(_State), ctypes.c_void_p, ctypes.c_int64]
    dll.sd_add.restype = None
    return dll


_LIB: ctypes.CDLL | bool | None = False


def _library() -> ctypes.CDLL | None:
    global _LIB
    if _LIB is False:
        try:
            _LIB = _compiled_library()
        except OSError as err:
            log.warning("what-if: cannot load the C helper (%s); using Python", err)
            _LIB = None
    return _LIB  # type: ignore[return-value]


class StackDistances:
    """LRU stack distances of an access stream over keys 0..num_keys-1, histogram of the last
    `window` accesses."""

    def __init__(self, num_keys: int, window: int = 100_000, *, native: bool = True) -> None:
        self.num_keys = num_keys
        self.window = window
        cap = max(4 * num_keys, 1 << 16)
        self.tree = np.zeros(cap + 1, dtype=np.int32)
        self.last = np.zeros(num_keys, dtype=np.int64)
        self.ring = np.zeros(window, dtype=np.int32)
        self.hist = np.zeros(num_keys + 1, dtype=np.int64)
        self.order = np.zeros(cap + 1, dtype=np.int64)
        self._state = _State(
            cap,
            0,
            num_keys,
            window,
            0,
            *(a.ctypes.data for a in (self.tree, self.last, self.ring, self.hist, self.order)),
        )
        self._lib = _library() if native else None

    @property
    def native(self) -> bool:
        return self._lib is not None

    @property
    def accesses(self) -> int:
        """Accesses counted in the histogram (at most `window`)."""
        return min(self._state.seen, self.window)

    def add(self, keys: np.ndarray) -> None:
        """Feed accesses in stream order."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if keys.size == 0:
            return
        assert keys.min() >= 0 and keys.max() < self.num_keys
        if self._lib is not None:
            self._lib.sd_add(ctypes.byref(self._state), keys.ctypes.data, keys.size)
        else:
            self._add_python(keys)

    def hit_rate(self, slots: int) -> float:
        """Hit rate an LRU cache of `slots` entries would have had on the recent window."""
        total = self.accesses
        if total == 0:
            return 0.0
        return float(self.hist[: max(0, min(slots, self.num_keys))].sum() / total)

    def curve(self, sizes: list[int]) -> list[dict]:
        cumulative = np.cumsum(self.hist)
        total = max(1, self.accesses)
        out = []
        for s in sizes:
            s = max(0, min(int(s), self.num_keys))
            out.append({"slots": s, "hit_rate": float(cumulative[s - 1] / total) if s else 0.0})
        return out

    # the reference implementation (and the fallback without a C compiler) -----------------------

    def _add_python(self, keys: np.ndarray) -> None:
        st = self._state
        tree, last, ring, hist = self.tree, self.last, self.ring, self.hist
        cap = st.cap

        def add(i: int, v: int) -> None:
            while i <= cap:
                tree[i] += v
                i += i & -i

        def prefix(i: int) -> int:
            s = 0
            while i > 0:
                s += int(tree[i])
                i -= i & -i
            return s

        for key in keys.tolist():
            if st.now == cap:
                self._compact_python()
            st.now += 1
            t = st.now
            prev = int(last[key])
            if prev == 0:
                dist = self.num_keys
            else:
                dist = prefix(t - 1) - prefix(prev)
                add(prev, -1)
            add(t, 1)
            last[key] = t
            slot = st.seen % self.window
            if st.seen >= self.window:
                hist[ring[slot]] -= 1
            ring[slot] = dist
            hist[dist] += 1
            st.seen += 1

    def _compact_python(self) -> None:
        st = self._state
        marked = np.nonzero(self.last)[0]
        order = marked[np.argsort(self.last[marked])]
        self.tree[:] = 0
        self.last[order] = np.arange(1, order.size + 1)
        for i in range(1, order.size + 1):
            j = i
            while j <= st.cap:
                self.tree[j] += 1
                j += j & -j
        st.now = order.size
