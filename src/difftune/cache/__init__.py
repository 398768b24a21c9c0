"""The split-training cache: stage 1 writes per-sample values here, stage 2 reads them back.

Generic: it stores dicts of named tensors and JSON values and knows nothing about models. Format and
guarantees: docs/cache_format.md.
"""

from .manifest import (FORMAT_VERSION, CacheManifest, file_identity, fingerprint_diff, fingerprint_hash, source_change,
                       source_identity)
from .reader import CacheReader
from .writer import CacheWriter, remove_cache
from .verify import VerifyReport, verify_cache

__all__ = ["CacheManifest", "CacheWriter", "CacheReader", "VerifyReport", "verify_cache",
           "fingerprint_hash", "fingerprint_diff", "file_identity", "source_identity", "source_change", "remove_cache",
           "FORMAT_VERSION"]
