"""Reading snapshot files ahead of need, on a small thread pool.

A request that matches parked (disk-only) nodes needs their files read, checked and
decoded before it can restore. The read and its CRC are plain I/O (no MLX, and zlib
releases the GIL), so they are started on a pool as soon as the files are known — for
every file of the request's path at once, so they overlap each other and the decoding
of the ones that arrived first, and, where a caller knows the prompt early (a request
not yet started, a server request being tokenized), the other work of the engine
thread. The verifier takes the bytes when it needs them (`take`), or reads the file
itself when nothing was prefetched. Bytes nobody takes are dropped oldest first past a
bound, so a prefetch never holds more than a few files' worth of memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Tuple

from .format import read_regular

FileKey = Tuple[Path, str]


class Prefetcher:
    """Reads files on a pool (`format.read_regular`: the same checks as a read on
    demand); `take` hands over what was read, or the read's error.

    Args:
        limit: bytes of unclaimed reads kept at most (oldest dropped first).
        workers: pool threads.
    """

    def __init__(self, limit: int = 512 << 20, workers: int = 2) -> None:
        self.limit = int(limit)
        self._workers = workers
        self._mu = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._jobs: "OrderedDict[FileKey, Tuple[Future, int]]" = OrderedDict()
        self._held = 0

    def start(self, key: FileKey, size: int, crc: int) -> None:
        """Begin reading ``key`` (``size`` bytes, CRC-32 ``crc``) unless it is being read
        or was read. Takes no lock a reader holds: safe under the verifier's."""
        with self._mu:
            if key in self._jobs:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="mlx_kvcache-read")
            self._jobs[key] = (self._pool.submit(read_regular, key[0], key[1], size, crc), size)
            self._held += size
            while self._held > self.limit and len(self._jobs) > 1:
                old, (fut, n) = self._jobs.popitem(last=False)
                fut.cancel()
                self._held -= n

    def take(self, key: FileKey) -> Optional[Future]:
        """The read of ``key`` if one was started (its result: the bytes, or the error);
        None otherwise. Each read is handed over once."""
        with self._mu:
            job = self._jobs.pop(key, None)
            if job is None:
                return None
            self._held -= job[1]
            return job[0]

    def forget(self, key: FileKey) -> None:
        """Drop a read of a file that was deleted or replaced."""
        fut = self.take(key)
        if fut is not None:
            fut.cancel()

    def close(self) -> None:
        with self._mu:
            pool, self._pool = self._pool, None
            self._jobs.clear()
            self._held = 0
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
