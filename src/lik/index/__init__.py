"""``lik.Index``: exact MaxSim search over packed corpora on the GPU, in host RAM, on disk and across GPUs.

Files by role: ``format`` (manifest, shards, checksums, atomic writes), ``building`` (documents and
:class:`DocumentBatch` es to shards, converted in batches), ``placement`` (where chunks come from and how they reach
the device), ``search`` (chunked top-k), ``distributed`` (merging ranks' top-k), ``documents`` (ids, removed
documents, compaction), ``index`` (the class).
"""

from .building import DocumentBatch
from .index import Index

__all__ = ["Index", "DocumentBatch"]
