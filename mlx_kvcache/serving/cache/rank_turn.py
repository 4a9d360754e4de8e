"""What the ranks of a sharded server settle once per turn of the generation loop.

Checkpoints must cost a small fraction of the prefill they save, and on a sharded model
every collective is a point where the ranks wait for each other (a pipeline rank that
could run ahead into the next prefill piece stops). So a request agrees once, at its
fetch (where it restores: one reduction, and one more that the restore worked), and
every insert after that — each checkpoint, the final one — is done on every rank alike
with no collective (`PrefixManager.defer_budget`): the trie's structure follows from the
tokens alone. What an insert leaves rank-local is settled at the next turn of mlx-lm's
generation loop, riding on the one tiny collective the loop issues there anyway (the stop
signal, `generator`), by what each rank contributes through `flags`:

* over budget: a rank holds more than its byte budget, or its snapshots more than the
  ceiling mlx-lm last asked for (``trim_to``); then every rank evicts together
  (`PrefixManager.settle`: one more collective, the same nodes everywhere);
* a node made without state: a rank whose cache list could not be stored (it does not
  hold exactly its tokens, e.g. a padded recurrent row) still made the node, with no
  state; then the ranks gather which nodes (one gather) and drop their states on every
  rank, removing the leaves among them — nothing is kept unless every rank could store
  it, as when every insert was agreed.

A turn's inserts are few (one per request in the batch per step); the budget holds again
at every turn, not after every insert.
"""

from __future__ import annotations

import struct
from typing import Dict, List, Optional, Sequence

from ...prefix.agreement import Agreement
from ...prefix.manager import PrefixManager
from ...prefix.node import TrieNode

_SEQ = struct.Struct("<q")


class RankTurn:
    """One rank's inserts since the last turn, and mlx-lm's last ``trim_to`` ceiling."""

    def __init__(self) -> None:
        #: mlx-lm's ``trim_to(n_bytes=...)``: this rank's ceiling for the snapshots, for
        #: the turn it was asked in.
        self.limit: Optional[int] = None
        self._seq = 0
        self._made: Dict[int, TrieNode] = {}  # this turn's inserts: sequence number -> node
        self._stateless: List[int] = []  # those that made a node with no state here

    @staticmethod
    def makes_node(manager: PrefixManager, tokens: Sequence[int]) -> bool:
        """Whether an insert of ``tokens`` will add a node (the trie lacks some of them;
        at a point inside an edge it only splits it). Structural: the same on every rank."""
        return manager.peek(lambda: manager.trie.find(tokens)[1] < len(tokens))

    def inserted(self, node: Optional[TrieNode], made: bool, stateless: bool) -> None:
        """Note an insert (every rank notes every insert, in the same order)."""
        self._seq += 1
        if node is not None:
            self._made[self._seq] = node
            if made and stateless:
                self._stateless.append(self._seq)

    def flags(self, manager: PrefixManager) -> List[int]:
        """This rank's part of the turn's collective: [over budget, made a node without
        state]; read-only."""
        over = manager.peek(lambda: manager.over_budget(self.limit))
        return [int(over), int(bool(self._stateless))]

    def settle(self, manager: PrefixManager, agree: Agreement, agreed: Sequence[int]) -> bool:
        """After every turn's collective (``agreed``: the ranks' `flags`, element-wise
        max), on every rank: acts only where a flag is up. Then the turn starts afresh.
        Returns whether the turn had inserts."""
        try:
            if agreed[1]:
                self._drop_stateless(manager, agree)
            if agreed[0]:
                manager.settle(self.limit)
            return bool(self._made)
        finally:
            self.limit = None  # mlx-lm asks again with each request it adds to its batch
            self._made.clear()
            self._stateless = []

    def _drop_stateless(self, manager: PrefixManager, agree: Agreement) -> None:
        mine = b"".join(_SEQ.pack(s) for s in self._stateless)
        seqs = sorted({_SEQ.unpack_from(b, i)[0] for b in agree.all_gather(mine)
                       for i in range(0, len(b), _SEQ.size)})

        def drop() -> None:
            trie = manager.trie
            for s in seqs:  # the same nodes, in the same order, on every rank
                node = self._made.get(s)
                if node is None or node.detached:
                    continue
                trie.set_snapshots(node, [None] * trie.num_layers)
                manager.keep.discard(node)
                if not node.children and not node.in_use:
                    trie.remove(node)
        manager.run(drop)
