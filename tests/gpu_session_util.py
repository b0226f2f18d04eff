"""Shared helpers of the GPU session tests: the relative error they hold logits to."""

from __future__ import annotations

import numpy as np


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
