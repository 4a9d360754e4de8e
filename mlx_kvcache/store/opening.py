"""Which index a store may read or write, and what it says about the others.

* For loading (`open_to_read`): an index of this format, this model (fingerprint) and these
  cache layers; anything else is ignored with one reason. A newer format's index is
  never opened by SQLite at all (its header says its version).
* For writing (`open_to_write`): the same index, or a fresh one replacing a damaged or
  another model's index (its files are then swept as unknown); never a newer format's.
* Older formats (format 1 directly under the root, format 2 under ``v2/``) are reported
  once per process and root (`legacy_note`) and left alone.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any, List, Optional, Set, Tuple

from .format import FORMAT_VERSION, MAGIC, FormatError, disk_usage, version_dir
from .index import INDEX, Index, header_version
from .lazy import warn

_TOLD_LEGACY: Set[Path] = set()


def legacy_note(root: Path, fingerprint: str) -> None:
    """One warning per process and root about caches of older formats found there."""
    if root in _TOLD_LEGACY:
        return
    for version, old in ((1, root / fingerprint[:16]), (2, version_dir(root, 2))):
        if (old / "index.json").exists() or (version == 2 and old.is_dir() and any(old.iterdir())):
            _TOLD_LEGACY.add(root)
            size = disk_usage(old) if version == 1 else sum(disk_usage(p) for p in old.iterdir())
            warn(f"ignoring a prefix cache written by an older mlx_kvcache (format "
                 f"{version}) at {old}; it is left as it is (delete it to reclaim {size} B)")


def is_ours(idx: Index, fingerprint: str, signature: List[Any]) -> Optional[str]:
    """None when ``idx`` belongs to this model; otherwise why not."""
    if idx.meta().get("format") != MAGIC:
        return "not a prefix cache index"
    header = idx.header()
    if header.get("fingerprint") != fingerprint:
        return "it was written for another model (fingerprint mismatch)"
    if header.get("layers") != json.loads(json.dumps(signature)):
        return "its cache layers do not match this model's"
    return None


def open_to_read(d: Path, fingerprint: str, signature: List[Any]) -> Tuple[Optional[Index], Optional[str], bool]:
    """``(index, why_not, newer)``: the usable index in ``d`` (None when there is none,
    ``why_not`` then says why unless there simply is no index); ``newer``: ``d`` holds a
    newer format, which must never be written."""
    version = header_version(d / INDEX)
    if version is None:
        return None, None, False
    if version > FORMAT_VERSION:
        return None, (f"format version {version} is newer than this build's "
                      f"({FORMAT_VERSION}); it is left as it is"), True
    idx = Index.open(d)
    try:
        why = is_ours(idx, fingerprint, signature)
    except BaseException:
        idx.close(checkpoint=False)
        raise
    if why is not None:
        idx.close(checkpoint=False)
        return None, why, False
    return idx, None, False


def open_to_write(d: Path, fingerprint: str, signature: List[Any], replace: bool) -> Tuple[Optional[Index], bool]:
    """``(index, made)``: ``d``'s index open for writing — made anew (``made``) when there
    is none, it is damaged, another model's, or ``replace``; None when ``d`` holds a newer
    format. Raises ``OSError`` when ``d`` cannot be written. Call with the directory lock
    held."""
    try:
        version = header_version(d / INDEX)
    except FormatError:
        version = -1  # damaged: replaced
    if version is not None and version > FORMAT_VERSION:
        return None, False
    idx = None
    if version == FORMAT_VERSION and not replace:
        try:
            idx = Index.open(d)
        except FormatError:
            idx = None
        if idx is not None and idx.readonly:
            idx.close()
            raise OSError(errno.EROFS, f"{d} cannot be written")
        if idx is not None and is_ours(idx, fingerprint, signature) is not None:
            idx.close(checkpoint=False)
            idx = None
    if idx is not None:
        return idx, False
    return Index.create(d, {"fingerprint": fingerprint, "layers": signature}), True
