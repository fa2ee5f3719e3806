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

    def put(self, key: str, tensor: torch.Tensor, crc: Optional[int] = None) -> IOFuture:
        return self.store.put(key, tensor, kind=self.kind, crc=crc)

    def get(self, key: str, out: Optional[torch.Tensor] = None, defer_check: bool = False) -> IOFuture:
        return self.store.get(key, out, kind=self.kind, defer_check=defer_check)

    def __getattr__(self, name: str):
        return getattr(self.store, name)
