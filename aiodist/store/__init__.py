"""Rendezvous key-value stores (async face). Blocking twins live in ``aiodist.store.blocking``."""

from aiodist.store.base import Store as Store
from aiodist.store.client import TCPStore as TCPStore
from aiodist.store.file import FileStore as FileStore
from aiodist.store.memory import HashStore as HashStore
from aiodist.store.prefix import PrefixStore as PrefixStore
from aiodist.store.server import StoreServer as StoreServer

__all__ = ["FileStore", "HashStore", "PrefixStore", "Store", "StoreServer", "TCPStore"]
