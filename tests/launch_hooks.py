"""A Triton launch hook for tests that must see every launch a profiler would (the cached and replayed paths step
aside while one is installed)."""

from __future__ import annotations

import contextlib

import triton


@contextlib.contextmanager
def recorded_launches():
    """Install a launch-enter hook for the block; yields the list it appends one entry per launch to, or None where
    this Triton has no HookChain launch hooks (the caller then has nothing to check)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime.launch_enter_hook, "add"):
        yield None
        return
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        yield seen
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
