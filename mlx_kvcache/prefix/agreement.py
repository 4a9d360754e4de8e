"""How the processes serving one sharded model agree on cache decisions.

Under ``mlx.launch`` every rank holds its own shard of each snapshot and runs the same
requests in the same order; a cache decision that changes which tokens a request
reprocesses (where it restores, what is stored or evicted, what is loaded from disk) must
be the same on every rank, or the ranks run different prompts and hang. Decisions made
from rank-local quantities — bytes (pipeline ranks hold different layers), which files are
intact, which layers a rank has — go through an `Agreement`: each rank contributes its
local view and all get the combined one. A single process uses `SOLO`, where agreeing is
the identity. The collective implementation lives with the server (`serving.cache.agreement`).
"""

from __future__ import annotations

from typing import List, Protocol, Sequence


class Agreement(Protocol):
    rank: int
    size: int

    def all_min(self, values: Sequence[int]) -> List[int]:
        """Element-wise minimum over ranks (every rank passes the same length)."""
        ...

    def all_max(self, values: Sequence[int]) -> List[int]:
        """Element-wise maximum over ranks (every rank passes the same length)."""
        ...

    def all_gather(self, data: bytes) -> List[bytes]:
        """Every rank's ``data``, in rank order (lengths may differ)."""
        ...


class Solo:
    """One process: every local view is already the agreed one."""

    rank = 0
    size = 1

    def all_min(self, values: Sequence[int]) -> List[int]:
        return list(values)

    def all_max(self, values: Sequence[int]) -> List[int]:
        return list(values)

    def all_gather(self, data: bytes) -> List[bytes]:
        return [bytes(data)]


SOLO = Solo()


def every(agree: Agreement, flag: bool) -> bool:
    """True when ``flag`` is true on every rank."""
    return bool(agree.all_min([int(bool(flag))])[0])


def any_rank(agree: Agreement, flag: bool) -> bool:
    """True when ``flag`` is true on some rank."""
    return bool(agree.all_max([int(bool(flag))])[0])
