"""A tiny llama whose attention layers keep their keys and values in a cache class that
neither mlx-lm nor mlx_kvcache knows (`PagedKVCache`): the stand-in for the next cache
class a model brings. `dirs.write_paged_model_dir` copies this file into a model
directory as its ``model.py`` (mlx-lm loads it through ``model_file`` with
``trust_remote_code``), so a real server process meets the class as a user's would.

Standalone on purpose: mlx-lm imports it from the model directory, not from this package.
"""

import mlx.core as mx
from mlx_lm.models import llama

ModelArgs = llama.ModelArgs


class PagedKVCache:
    """Keys and values in pages of `PAGE` rows (a list of arrays, appended page by page).
    Not trimmable, no batching (``merge``): mlx-lm's server serves its model one request
    at a time and its prompt cache reuses only exact and shorter prefixes."""

    PAGE = 16

    def __init__(self):
        self.pages = []  # [(keys, values)], each [B, H, <= PAGE, D]
        self.offset = 0

    def update_and_fetch(self, keys, values):
        n, i = keys.shape[2], 0
        while i < n:
            if self.pages and self.pages[-1][0].shape[2] < self.PAGE:
                k, v = self.pages[-1]
                take = min(self.PAGE - k.shape[2], n - i)
                self.pages[-1] = (mx.concatenate([k, keys[..., i:i + take, :]], axis=2),
                                  mx.concatenate([v, values[..., i:i + take, :]], axis=2))
            else:
                take = min(self.PAGE, n - i)
                self.pages.append((keys[..., i:i + take, :], values[..., i:i + take, :]))
            i += take
        self.offset += n
        return (mx.concatenate([k for k, _ in self.pages], axis=2),
                mx.concatenate([v for _, v in self.pages], axis=2))

    @property
    def state(self):
        return [a for kv in self.pages for a in kv]

    @state.setter
    def state(self, arrays):
        self.pages = [(arrays[i], arrays[i + 1]) for i in range(0, len(arrays), 2)]

    @property
    def meta_state(self):
        return str(self.offset)

    @meta_state.setter
    def meta_state(self, v):
        self.offset = int(v)

    def is_trimmable(self):
        return False

    def empty(self):
        return not self.pages

    def size(self):
        return self.offset

    @property
    def nbytes(self):
        return sum(k.nbytes + v.nbytes for k, v in self.pages)


class Model(llama.Model):
    def make_cache(self):
        return [PagedKVCache() for _ in self.layers]
