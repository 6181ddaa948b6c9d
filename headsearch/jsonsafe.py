"""JSON has no NaN, infinity or numpy types: one conversion for every file headsearch writes."""
from __future__ import annotations

import math
from typing import Any


def json_safe(x: Any) -> Any:
    """Nested dicts/lists/tuples/numpy arrays and scalars -> plain JSON values; NaN and infinities -> None."""
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):  # numpy arrays and scalars
        x = x.tolist()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
