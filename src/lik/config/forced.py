"""The registry of forced launch configurations (:func:`lik.config.override`), read by every heuristic first."""

from __future__ import annotations

import contextlib

__all__ = ["FORCED", "forced", "override", "register"]

# Key -> the config a heuristic returns while forced; empty outside ``override`` blocks.
FORCED: dict[str, object] = {}
# Key -> the config class it takes, filled by the heuristics modules as they are imported.
_KINDS: dict[str, type] = {}


def register(key: str, kind: type) -> None:
    """Declare an ``override`` key and the dataclass its value must be (called by each heuristics module)."""
    _KINDS[key] = kind


def forced(key: str):
    """The config forced for ``key``, or None."""
    return FORCED.get(key)


@contextlib.contextmanager
def override(**configs):
    """Force launch configurations inside a ``with`` block: each heuristic returns the config given for its key
    (``maxsim_forward``, ``maxsim_backward``, ``maxsim_varlen``, ``msda_forward``, ``msda_backward``,
    ``nearest``) instead of choosing one. Blocks nest; leaving one restores what was forced before it. While
    anything is forced, no recorded launch is replayed (every call takes the full path with the forced tiles).

    Raises ValueError for an unknown key and TypeError for a value that is not that key's config class.

    Example:
        >>> from lik.config import MaxSimForwardConfig, override
        >>> with override(maxsim_forward=MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=128)):
        ...     scores = lik.maxsim(Q, D)
    """
    unknown = set(configs) - set(_KINDS)
    if unknown:
        raise ValueError(f"unknown config keys: {sorted(unknown)} (known: {sorted(_KINDS)})")
    for key, value in configs.items():
        if not isinstance(value, _KINDS[key]):
            raise TypeError(f"{key} must be a {_KINDS[key].__name__}, got {type(value).__name__}")
    saved = dict(FORCED)
    FORCED.update(configs)
    try:
        yield
    finally:
        FORCED.clear()
        FORCED.update(saved)
