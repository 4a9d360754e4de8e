"""Reading values out of the metadata dict that ``mx.load(..., return_metadata=True)`` returns."""

from __future__ import annotations

from .errors import ModelLoadError


def meta_py(v):
    """mx.load metadata values are mx.array, str or list[str]; make them Python."""
    if hasattr(v, "tolist") and not isinstance(v, (str, list)):
        return v.tolist()
    return v


def meta_value(meta: dict, key: str, default=None, *, required: bool = False, path=""):
    if key in meta:
        return meta_py(meta[key])
    if required:
        raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is missing")
    return default


def meta_scalar(meta, key, typ, default=None, *, required=False, path=""):
    v = meta_value(meta, key, default, required=required, path=path)
    if v is None:
        return None
    if isinstance(v, list):
        if len(set(v)) == 1:
            v = v[0]
        else:
            raise ModelLoadError(
                f"{path}: per-layer values for {key!r} are not supported ({v[:8]}...)"
            )
    try:
        return typ(v)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: bad value for GGUF key {key!r}: {v!r}") from e

