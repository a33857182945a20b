"""Exact top-k MaxSim search over corpora resident on the device (host / on-disk / sharded corpora to come)."""

from .exact import search

__all__ = ["search"]
