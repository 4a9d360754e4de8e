"""Loading on the ranks of a sharded model: every rank ends with the same trie.

Each rank saved its own shard of each snapshot, in its own directory; any of them may be
missing, damaged or older than the others (a write that failed). After the local load,
every file is read and checked now rather than lazily (a damage found later would be
found on one rank only), then the ranks keep only the nodes every one of them loaded
intact, and give them the same least-recently-used stamps. Nodes are named by the SHA-256
of their token prefix, which is the same on every rank.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Dict, List, Tuple

import numpy as np

from ..prefix.agreement import Agreement

_REC = struct.Struct("<32sqB")  # prefix digest, saved last-used stamp, keep flag


def _digests(trie) -> Dict[int, bytes]:
    out: Dict[int, bytes] = {}
    hashes = {id(trie.root): hashlib.sha256()}
    for n in trie.nodes():  # parents before children
        h = hashes[id(n.parent)].copy()
        h.update(np.asarray(n.tokens, dtype=np.int64).tobytes())
        hashes[id(n)] = h
        out[id(n)] = h.digest()
    return out


def agree_loaded(store, agree: Agreement, saved: Dict[int, int]) -> int:
    """Reconcile a just-loaded trie with the other ranks'. ``saved`` maps id(node) to the
    last-used stamp its index recorded. Returns the tokens kept."""
    trie = store.trie
    for n in list(trie.nodes()):
        if n.detached:
            continue
        if not all(store.verifier.ensure_all(n.snapshots)):
            store.tier.drop_subtree(n)
        elif n.parked:  # checked: parked again, to be filled (and checked) when needed
            store.tier.demote(n)
    nodes = list(trie.nodes())
    names = _digests(trie)
    mine = b"".join(_REC.pack(names[id(n)], saved.get(id(n), 0), int(n in store.keep))
                    for n in nodes)
    views: List[Dict[bytes, Tuple[int, int]]] = []
    for blob in agree.all_gather(mine):
        views.append({d: (lu, k) for d, lu, k in _REC.iter_unpack(blob)})
    common = set(views[0]).intersection(*views[1:])
    for n in nodes:  # parents first: a dropped parent takes its subtree along
        if not n.detached and names[id(n)] not in common:
            store.tier.drop_subtree(n)
    kept = [n for n in trie.nodes()]
    stamp = {d: max(v[d][0] for v in views) for d in common}
    keep = {d for d in common if any(v[d][1] for v in views)}
    top = max([trie.clock] + [stamp[names[id(n)]] for n in kept])
    trie.set_clock(agree.all_max([top])[0])
    for n in kept:  # the same stamp on every rank: eviction picks the same nodes
        n.last_used = stamp[names[id(n)]]
        if names[id(n)] in keep:
            store.keep.add(n)
        else:
            store.keep.discard(n)
    return sum(len(n.tokens) for n in kept)
