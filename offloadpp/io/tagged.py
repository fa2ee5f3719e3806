"""TaggedStore: a TensorStore whose puts and gets count under one kind tag."""

from __future__ import annotations

from typing import Optional

import torch

from .future import IOFuture


class TaggedStore:
    """A TensorStore whose puts and gets count under one kind (TensorStore.bytes_by_kind):
    handed to the runtime's arrays so the accounting is made at the I/O calls themselves."""

    __slots__ = ("store", "kind")

    def __init__(self, store, kind: str):
        self.store = store
        self.kind = kind

    def put(self, key: str, tensor: torch.Tensor) -> IOFuture:
        return self.store.put(key, tensor, kind=self.kind)

    def get(self, key: str, out: Optional[torch.Tensor] = None) -> IOFuture:
        return self.store.get(key, out, kind=self.kind)

    def __getattr__(self, name: str):
        return getattr(self.store, name)
