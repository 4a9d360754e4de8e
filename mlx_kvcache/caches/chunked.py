"""`ChunkedKVCache`: chunked attention (llama4), with snapshot / restore by correct rules.

A query at position ``q`` attends only to the keys of its own chunk, positions
``[q - q % C, q]`` (``C = chunk_size``). The model trims the cache's front
(`maybe_trim_front`) so it holds about the last ``C`` rows, counted from
``start_position``; llama4 builds its mask from the first layer's ``start_position``, so
every chunked layer must hold rows from the same position.

The state at offset ``t`` is therefore exactly the rows ``[chunk_start(t), t)`` — none at
all on a chunk boundary. A cache (or a chain of snapshots) reaches ``t`` iff it holds those
rows; mlx-lm's own ``trim`` only lowers the offset and so can land where the chunk's first
rows were already trimmed away (mlx-lm#1494). Here every restore checks the rows and then
holds exactly ``[chunk_start(t), t)`` with ``start_position = chunk_start(t)``, the same on
every layer whatever the source.

Snapshots are deltas: the rows ``[max(a, start_position), b)`` of a node ``[a, b)`` — all of
its rows when prefill stops at least every ``C`` tokens (the manager arranges that), fewer
after a long uninterrupted stretch. Reuse is then as good as correctness allows: any
target whose chunk rows some chain of live rows and snapshots holds, and every chunk
boundary, at the memory cost of a plain KV layer in the trie (no row is stored twice). The
alternative — a whole window at node ends — would duplicate up to ``C`` rows in every
node of a conversation and restore only at node ends.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlc

from .buffers import KVBuffers, SnapshotKV
from .checks import check_kv, check_offset, check_snapshot, check_target
from .merging import MergeDispatch
from .reach import Reach, Runs, Span
from .rollback import Rollback
from .snapshot import CacheError, Snapshot, compact


class ChunkedSnapshot(SnapshotKV, Snapshot):
    """Rows ``[rows_from, to_offset)`` of a node ``[from_offset, to_offset)``
    (``rows_from >= from_offset``; the rows below it were already trimmed away)."""

    kind = "chunked"
    needs_base = True

    def __init__(self, from_offset, to_offset, arrays, rows_from: int, chunk_size: int):
        super().__init__(from_offset, to_offset, arrays)
        self.rows_from, self.chunk_size = int(rows_from), int(chunk_size)

    def meta(self):
        return {**super().meta(), "rows_from": self.rows_from, "chunk_size": self.chunk_size}

    @classmethod
    def _from_arrays(cls, arrays, meta):
        try:
            a, b = int(meta["from_offset"]), int(meta["to_offset"])
            r, c = int(meta["rows_from"]), int(meta["chunk_size"])
            k, v = arrays["keys"], arrays["values"]
        except KeyError as e:
            raise CacheError(f"chunked snapshot is missing {e}") from None
        if not a <= r < b or k.ndim != 4 or v.ndim != 4 or k.shape[2] != b - r or v.shape[2] != b - r:
            raise CacheError(f"chunked snapshot arrays {tuple(k.shape)} / {tuple(v.shape)} do not "
                             f"cover rows [{r}, {b}) of [{a}, {b})")
        return cls(a, b, {"keys": k, "values": v}, r, c)


#: A run of rows: ``(first position, end position, keys, values)``.
_Piece = Tuple[int, int, mx.array, mx.array]


class ChunkedKVCache(KVBuffers, Rollback):
    """Drop-in for mlx-lm's ``ChunkedKVCache`` (llama4): ``keys`` / ``values`` hold the
    rows ``[start_position, offset)``; ``offset`` is the absolute position of the next token."""

    step = 256
    #: Snapshots are deltas over the rows below them (the budget counts only new rows).
    delta_snapshots = True

    def __init__(self, chunk_size: int) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise CacheError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0
        self.start_position = 0

    def chunk_start(self, t: int) -> int:
        """First position of the chunk the token at ``t`` belongs to."""
        return t - t % self.chunk_size

    # -- writing (mlx-lm's semantics) --------------------------------------------------
    def maybe_trim_front(self) -> None:
        """Keep at most ``chunk_size`` rows (the model calls this before each forward pass)."""
        held = self.offset - self.start_position
        if self.keys is not None and held > self.chunk_size:
            cut = held - self.chunk_size
            self.start_position += cut
            self.keys = self.keys[..., cut:held, :]
            self.values = self.values[..., cut:held, :]

    def _write(self, keys: mx.array, values: mx.array) -> None:
        prev, n = self.offset - self.start_position, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, dk = keys.shape
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step:
                    self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
        self.offset += n
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values

    def update(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append ``[B, H, L, D]`` keys/values; return the rows held (from ``start_position``)."""
        check_kv(keys, values, self.keys, self.values)
        self._write(keys, values)
        return self.keys_and_values()

    update_and_fetch = update

    def keys_and_values(self) -> Tuple[mx.array, mx.array]:
        end = self.offset - self.start_position
        return self.keys[..., :end, :], self.values[..., :end, :]

    def free(self) -> None:
        """Drop all state; ``offset`` becomes 0."""
        self.keys = self.values = None
        self.offset = self.start_position = 0

    # -- snapshot face ----------------------------------------------------------------
    def snapshot(self, from_offset: int = 0) -> Optional[ChunkedSnapshot]:
        """Compact copy of the rows held in ``[from_offset, offset)``; None when there are none."""
        from_offset = check_offset("from_offset", from_offset, self.offset)
        lo = max(from_offset, self.start_position)
        if self.keys is None or lo >= self.offset:
            return None
        r0, r1 = lo - self.start_position, self.offset - self.start_position
        k, v = compact(self.keys[..., r0:r1, :]), compact(self.values[..., r0:r1, :])
        mx.eval(k, v)
        return ChunkedSnapshot(from_offset, self.offset, {"keys": k, "values": v}, lo, self.chunk_size)

    def snapshot_nbytes(self, from_offset: int = 0) -> int:
        """Bytes ``snapshot(from_offset)`` would hold (nothing is copied)."""
        lo = max(from_offset, self.start_position)
        if self.keys is None or lo >= self.offset:
            return 0
        return (self.offset - lo) * self._row_bytes()

    def _own(self, end: int) -> List[_Piece]:
        end = min(end, self.offset)
        if self.keys is None or end <= self.start_position:
            return []
        r = end - self.start_position
        return [(self.start_position, end, self.keys[..., :r, :], self.values[..., :r, :])]

    def _assemble(self, pieces: Sequence[_Piece], target: int) -> bool:
        """Hold exactly rows ``[chunk_start(target), target)``, taken from ``pieces``; False
        (no change) when some row is in none of them."""
        lo = self.chunk_start(target)
        ks, vs = [], []
        cur = lo
        while cur < target:
            p = next((p for p in pieces if p[0] <= cur < p[1]), None)
            if p is None:
                return False
            hi = min(p[1], target)
            ks.append(p[2][..., cur - p[0] : hi - p[0], :])
            vs.append(p[3][..., cur - p[0] : hi - p[0], :])
            cur = hi
        if ks:
            B, H, _, dk = ks[0].shape
            pad = self.step - (target - lo) % self.step  # room to grow; never a bare snapshot array
            ks.append(mx.zeros((B, H, pad, dk), ks[0].dtype))
            vs.append(mx.zeros((B, H, pad, vs[0].shape[3]), vs[0].dtype))
            self.keys, self.values = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
        else:  # a chunk boundary: the next token's chunk starts empty
            self.keys = self.values = None
        self.offset, self.start_position = target, lo
        return True

    def reaches(self, target: int) -> bool:
        """Whether ``restore(None, target)`` would succeed."""
        if target > self.offset:
            return False
        return target % self.chunk_size == 0 or (self.keys is not None
                                                 and self.start_position <= self.chunk_start(target))

    def restore(self, snapshot: Optional[ChunkedSnapshot], target: int) -> bool:
        """Bring the cache to ``target`` tokens, holding exactly ``[chunk_start(target), target)``.

        ``snapshot=None``: any ``target <= offset`` whose chunk rows the cache still holds
        (or a chunk boundary). A snapshot: ``target <= snapshot.to_offset``, the rows taken
        from the cache's own rows below ``snapshot.from_offset`` and the snapshot's. False,
        changing nothing, when a needed row is in neither.
        """
        if check_target(target) is None:
            return False
        if snapshot is None:
            return self.reaches(target) and self._assemble(self._own(target), target)
        return self.restore_rows([snapshot], target, snapshot.from_offset)

    def restore_rows(self, snapshots: Sequence[ChunkedSnapshot], target: int, base: int) -> bool:
        """Bring the cache to ``target`` from its own rows below ``base`` and the rows of
        ``snapshots`` (positions in order along one token sequence). ``target`` must be at
        most the last snapshot's end (or ``base``). False, changing nothing, when unreachable."""
        target = check_target(target)
        if target is None:
            return False
        for s in snapshots:
            check_snapshot(s, ChunkedSnapshot, "ChunkedKVCache.restore")
            if s.chunk_size != self.chunk_size:
                raise CacheError(f"snapshot chunk size {s.chunk_size} does not match the cache's "
                                 f"{self.chunk_size}")
            like_k, like_v = (self.keys, self.values) if self.keys is not None else (
                snapshots[0].keys, snapshots[0].values)
            check_kv(s.keys, s.values, like_k, like_v)
        ends = [s.to_offset for s in snapshots] + [min(base, self.offset)]
        if target > max(ends):
            return False
        pieces = self._own(base) + [(s.rows_from, s.to_offset, s.keys, s.values) for s in snapshots]
        return self._assemble(pieces, target)

    merge = MergeDispatch()

    def merge_snapshots(self, parent: ChunkedSnapshot, child: ChunkedSnapshot) -> ChunkedSnapshot:
        """Adjacent ``[a, b)`` + ``[b, c)`` -> ``[a, c)``: the rows concatenate when the child
        holds all of its own, else the child's rows alone survive. Closes both."""
        check_snapshot(parent, ChunkedSnapshot, "ChunkedKVCache.merge")
        check_snapshot(child, ChunkedSnapshot, "ChunkedKVCache.merge")
        if parent.to_offset != child.from_offset:
            raise CacheError(f"cannot merge non-adjacent snapshots [{parent.from_offset}, "
                             f"{parent.to_offset}) and [{child.from_offset}, {child.to_offset})")
        if child.rows_from == child.from_offset:
            check_kv(child.keys, child.values, parent.keys, parent.values)
            k = mx.concatenate([parent.keys, child.keys], axis=2)
            v = mx.concatenate([parent.values, child.values], axis=2)
            mx.eval(k, v)
            rows_from = parent.rows_from
        else:
            k, v, rows_from = child.keys, child.values, child.rows_from
        out = ChunkedSnapshot(parent.from_offset, child.to_offset, {"keys": k, "values": v},
                              rows_from, child.chunk_size)
        parent.close()
        child.close()
        return out

    def split(self, snapshot: ChunkedSnapshot, at: int):
        """Cut ``[a, c)`` at ``at``: the head keeps the rows below ``at`` (None when it has
        none), the tail the rows from ``at`` on. Takes ownership of the input."""
        check_snapshot(snapshot, ChunkedSnapshot, "ChunkedKVCache.split")
        at = check_offset("at", at)
        a, c, r = snapshot.from_offset, snapshot.to_offset, snapshot.rows_from
        if at <= a:
            return None, snapshot
        if at >= c:
            return snapshot, None
        k, v, cs = snapshot.keys, snapshot.values, snapshot.chunk_size
        head = None
        if r < at:
            hk, hv = compact(k[..., : at - r, :]), compact(v[..., : at - r, :])
            mx.eval(hk, hv)
            head = ChunkedSnapshot(a, at, {"keys": hk, "values": hv}, r, cs)
        t0 = max(r, at) - r
        tk, tv = compact(k[..., t0:, :]), compact(v[..., t0:, :])
        mx.eval(tk, tv)
        snapshot.close()
        return head, ChunkedSnapshot(at, c, {"keys": tk, "values": tv}, max(r, at), cs)

    # -- restore along a stored prefix (`reach`) -----------------------------------------
    #: Kind rules (`reach`): a chunk's rows come back from runs of stored rows.
    any_offset = False
    quantizable = False
    #: Why a restore landed short, in words (`prefix.explain`).
    restore_rule = "chunked-attention layers restore only where their chunk's rows are held"

    @property
    def interval_cap(self) -> int:
        """The layer keeps only about one chunk of rows: a snapshot at least once a chunk
        lets every stored span hold all of its rows (reach at any token)."""
        return self.chunk_size

    def reach(self, spans: Sequence[Span], live_common: int, top: int, quant: Any = None) -> Reach:
        """Any chunk boundary, and any offset whose chunk rows lie in one run of the rows
        the live cache and the spans' snapshots hold."""
        held = []
        live = min(live_common, self.offset)
        if self.keys is not None and self.start_position < live:
            held.append((self.start_position, live))
        for start, end, s in spans:
            if start >= top:
                break
            if isinstance(s, ChunkedSnapshot):
                lo, hi = s.rows_from, min(end, top)
                if lo < hi:
                    held.append((lo, hi))
        runs: List[List[int]] = []
        for lo, hi in sorted(held):
            if runs and lo <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], hi)
            else:
                runs.append([lo, hi])
        return Runs(self.chunk_size, runs)

    def restore_along(self, spans: Sequence[Span], t: int, live_common: int, room: int = 0) -> bool:
        """A chunk boundary (no rows needed), or the chunk's rows from the live cache (below
        ``live_common``) and the spans' snapshots."""
        if t % self.chunk_size == 0:
            return self._assemble([], t)
        snaps = [s for start, _, s in spans if start < t and isinstance(s, ChunkedSnapshot)]
        return self.restore_rows(snaps, t, min(live_common, t)) and self.offset == t

    def targets(self, top: int) -> List[int]:
        """The last chunk boundary at or below ``top``: no rows are needed there."""
        return [top - top % self.chunk_size]

    def snapshot_rows(self, tokens: int) -> int:
        return min(tokens, int(self.chunk_size))

    # -- mlx-lm face (no make_mask: llama4 builds its own chunk mask) ---------------------
    @property
    def state(self) -> Tuple[Any, ...]:
        """``(keys, values, offset, chunk_size, start_position)``: the whole buffer (room to
        grow included), mlx-lm 0.32's layout."""
        return self.keys, self.values, self.offset, self.chunk_size, self.start_position

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, offset, chunk_size, start = v
        self.offset, self.chunk_size, self.start_position = int(offset), int(chunk_size), int(start)

    def signature(self, quantization: Any = None) -> List[Any]:
        """Kind and settings (`factory.layer_signature`)."""
        return ["chunked", self.chunk_size]

    def to_mlx(self) -> Any:
        """mlx-lm's ``ChunkedKVCache`` holding these rows, sharing the arrays."""
        n = mlc.ChunkedKVCache(self.chunk_size)
        if self.keys is not None:
            n.keys, n.values = self.keys_and_values()
        n.offset, n.start_position = self.offset, self.start_position
        return n

    def adopt_length(self, length: int, quant: Any = None) -> bool:
        """Made from mlx-lm's class (`from_mlx`): whether it holds exactly ``length``
        tokens (at a chunk boundary it may hold no rows)."""
        return self.offset == length

    #: The mlx-lm class this one stands for (`factory.convert` turns one into the other).
    mlx_class = mlc.ChunkedKVCache

    @classmethod
    def from_mlx(cls, c: Any) -> "ChunkedKVCache":
        """Ours holding what mlx-lm's ``ChunkedKVCache`` ``c`` holds, sharing its arrays (no copy)."""
        out = cls(int(c.chunk_size))
        if c.keys is not None:
            out.keys, out.values = c.keys, c.values
        out.offset, out.start_position = int(c.offset), int(c.start_position)
        return out

    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> Any:
        """Refused, as mlx-lm's ``ChunkedKVCache`` (it has no batch form)."""
        raise ValueError(f"{cls.__name__} does not support batching (mlx-lm's does not "
                         f"either): generate one sequence at a time")

    @classmethod
    def from_state(cls, state) -> "ChunkedKVCache":
        obj = cls(int(state[3]))
        obj.state = state
        return obj

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Rewind ``n`` tokens. Raises `CacheError` (changing nothing) where the rows of the
        new position's chunk were already trimmed away: going on would attend to too few
        keys (mlx-lm's ``trim`` does, mlx-lm#1494)."""
        n = min(self.offset, int(n))
        if not self.restore(None, self.offset - n):
            raise CacheError(f"cannot rewind a chunked cache from {self.offset} to {self.offset - n}: "
                             f"the rows of that chunk from {self.chunk_start(self.offset - n)} on "
                             f"are no longer held (it holds {self.start_position}..{self.offset})")
        return n

    def size(self) -> int:
        return self.offset - self.start_position

    def __repr__(self) -> str:
        return (f"ChunkedKVCache(chunk_size={self.chunk_size}, offset={self.offset}, "
                f"start_position={self.start_position})")
