"""What rules remember about a meta tensor's storage between ops, for as long as it lives.

A rule that needs to know, at a later op, where a tensor came from (a one-hot routing
mask, ``topk``'s indices, a fresh gradient buffer) keeps a ``StorageTags`` table. Views
share their base's storage, so a tag follows ``permute``/``view``/``select`` with no
rule of its own; an entry goes when its storage is freed, so a reused address never
inherits it.
"""

from __future__ import annotations

import weakref

import torch


def _storage(t):
    if not (isinstance(t, torch.Tensor) and t.device.type == "meta"):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class StorageTags:
    """A table from meta storages to values; ``get`` for any tensor on a tagged storage."""

    def __init__(self):
        self._table: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, t):
        """The value tagged on ``t``'s storage, or None."""
        st = _storage(t)
        entry = self._table.get(st._cdata) if st is not None else None
        return entry[1] if entry is not None and entry[0]() is st else None

    def put(self, t, value) -> None:
        """Tag ``t``'s storage with ``value`` (nothing for a tensor that is not on meta)."""
        st = _storage(t)
        if st is None:
            return
        key = st._cdata

        def forget(ref, key=key):
            if self._table.get(key, (None,))[0] is ref:
                del self._table[key]

        self._table[key] = (weakref.ref(st, forget), value)
