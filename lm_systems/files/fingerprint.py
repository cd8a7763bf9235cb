"""``fingerprint``: a short stable hash of a JSON-serialisable value, naming cache entries (the data caches, the
kernels' tuning cache) by everything they depend on."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def fingerprint(value: Any, length: int = 16) -> str:
    """Short stable hash of a JSON-serialisable value (dict keys sorted), used to name cache entries."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]
