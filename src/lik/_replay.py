"""One replay mechanism for every op: a call that repeats a recorded call's key relaunches its kernels with its own
addresses, skipping the checks, the heuristics, the argument building and the launch keys.

A small call is host bound: validating the inputs, choosing the tile and building and keying a launch of ~45
arguments cost more host time than its kernel takes on the device (docs/design.md, "The host path"). What those
steps compute is fixed by a key of the call that an op reads from its arguments (shapes, strides, dtypes, devices,
16-byte alignment, the flags that choose the path: :func:`tensor_key` does a tensor's part). An op declares which
tensors are the caller's (its *sources*) and which the call makes (its *buffers*); the first call with a key runs
the full path inside :func:`recording`, which sees every launch (:data:`lik._launch.WATCH`), and :func:`plan_of`
turns those launches into :class:`Step` s whose every tensor argument is a source or a buffer (plus a fixed byte
offset: a view) and every other argument a value. A later call with the key makes its buffers and runs the steps.

Replays are bitwise the full path's: the same compiled kernels get the same arguments, only read from a table.
They run only where :func:`lik._launch.launch` replays Triton's launcher (the Triton releases of
``lik._launch.TESTED_TRITON``, no launch hook installed) and no config is forced (:func:`allowed`); elsewhere every
call takes the full path, which launches through Triton's own ``kernel[grid](...)``.

A launch that read a tensor which is neither a source nor a buffer (a copy made on the way: an integer mask turned
bool, a strided scale made contiguous) cannot be replayed, since that tensor's address changes with every call: its
key is filed as :data:`NEVER`. A launch given two sources that overlap in memory is not filed (which one a slot
reads is ambiguous), nor is one that went through Triton's own path.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from . import _launch
from .config.forced import FORCED

__all__ = [
    "allowed", "tensor_key", "layout_key", "recording", "Recording", "made", "note", "plan_of", "Plan", "Step",
    "NEVER", "file", "LIMIT",
]

# A key whose calls make a tensor of their own that a replay could not make again: the full path, always.
NEVER = "never"
# Entries an op's table holds at most (the table is emptied when full: shapes that stop repeating go).
LIMIT = 256


def allowed() -> bool:
    """Whether a recorded launch may be replayed now: the launch cache replays Triton's launcher (a tested Triton, no
    launch hook installed: a profiler's hook must see every launch), no config is forced, and no call is being
    recorded (an op called inside another's full path, as ``lik.quantize`` inside ``lik.maxsim``'s, must launch
    where the recording sees it). Ops test it before computing a key, so a call made while it is False takes the
    full path."""
    return not FORCED and _ACTIVE is None and _launch.replay_allowed()


def tensor_key(x: torch.Tensor) -> tuple:
    """What a tensor contributes to a call's key: shape, strides, dtype, device, whether it requires grad, and its
    address modulo 16 (which fixes the 16-byte alignment of every view at a fixed offset from it)."""
    return x.shape, x.stride(), x.dtype, x.get_device(), x.requires_grad, x.data_ptr() & 15


def layout_key(x: torch.Tensor) -> tuple:
    """:func:`tensor_key` without ``requires_grad``, for launchers that are the same whether a gradient is wanted
    (deformable attention's forward serves inference and training alike)."""
    return x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15


def file(table: dict, key, value) -> None:
    """``table[key] = value``, emptying ``table`` first when it holds :data:`LIMIT` entries."""
    if len(table) >= LIMIT:
        table.clear()
    table[key] = value


class Recording:
    """What a call's full path did on this thread while the recording was on: the launches
    :func:`lik._launch.launch` made, as ``(kernel, grid, args, kwargs)``; the tensors it announced with :func:`made`
    (in order); the facts it noted with :func:`note` for the op's replay."""

    __slots__ = ("launches", "made", "notes", "thread")

    def __init__(self):
        self.launches: list[tuple] = []
        self.made: list[torch.Tensor] = []
        self.notes: dict = {}
        self.thread = threading.get_ident()

    def __call__(self, kernel, grid, args, kwargs) -> None:
        if threading.get_ident() == self.thread:  # another thread's launches are not this call's
            self.launches.append((kernel, grid, args, kwargs))


_RECORDING_LOCK = threading.Lock()
_ACTIVE: Recording | None = None


def made(tensor: torch.Tensor) -> torch.Tensor:
    """Announce a tensor the call made that its kernels read or write and that a replay makes again (a buffer),
    in the order a replay makes them; returns ``tensor``. Nothing happens unless this thread is recording."""
    if _ACTIVE is not None and _ACTIVE.thread == threading.get_ident():
        _ACTIVE.made.append(tensor)
    return tensor


def note(name: str, value) -> None:
    """Tell the recording a fact the op's replay needs (which buffer holds the result, how documents were
    chunked); nothing happens unless this thread is recording."""
    if _ACTIVE is not None and _ACTIVE.thread == threading.get_ident():
        _ACTIVE.notes[name] = value


@contextlib.contextmanager
def recording():
    """Record the launches made inside the block; yields the :class:`Recording`, or None when another recording is
    on (the call then runs unrecorded)."""
    if not _RECORDING_LOCK.acquire(blocking=False):
        yield None
        return
    global _ACTIVE
    recorded = _ACTIVE = Recording()
    _launch.WATCH = recorded
    try:
        yield recorded
    finally:
        _launch.WATCH = _ACTIVE = None
        _RECORDING_LOCK.release()


class Step:
    """One recorded launch, replayed by ``step(sources, buffers)``: the kernel Triton compiled for the recorded call,
    on the current stream of the recorded device, with every tensor argument read from ``sources[i]`` or
    ``buffers[j]`` (its address plus the recorded offset) and every other argument the recorded value.

    The argument list is one generated expression, so a replay costs one ``data_ptr()`` per tensor it reads."""

    __slots__ = ("slots", "replay", "_run")

    def __init__(self, replay, slots: tuple):
        self.replay, self.slots = replay, slots
        values, lines, parts = [], [], []
        for slot in slots:
            if slot[0] == "value":
                values.append(slot[1])
                parts.append(f"v[{len(values) - 1}]")
                continue
            kind, index, offset = slot
            name = f"{kind}{index}"
            line = f"    {name} = {'s' if kind == 'source' else 'b'}[{index}].data_ptr()\n"
            if line not in lines:
                lines.append(line)
            parts.append(f"{name} + {offset}" if offset else name)
        grid = replay.grid
        source = (f"def step(s, b):\n{''.join(lines)}"
                  f"    run({grid[0]}, {grid[1]}, {grid[2]}, stream(device), function, packed, None, None, None, "
                  f"{''.join(p + ', ' for p in parts)}*tail)\n")
        scope = {"run": replay.run, "stream": _launch._get_stream, "device": replay.device,
                 "function": replay.function, "packed": replay.packed, "tail": replay.tail, "v": tuple(values)}
        exec(source, scope)  # noqa: S102 (a fixed template: only indices and offsets are substituted)
        self._run = scope["step"]

    def __call__(self, sources, buffers=()) -> None:
        self._run(sources, buffers)


class Plan:
    """The steps of one recorded call, in launch order; ``buffers`` holds each buffer's ``(shape, dtype)`` as the
    recorded call made it (contiguous), for :meth:`allocate`; ``notes`` what the full path noted; ``device`` the
    device of its first source."""

    __slots__ = ("steps", "buffers", "notes", "device", "_runs")

    def __init__(self, steps: tuple[Step, ...], buffers: tuple, notes: dict, device: torch.device):
        self.steps, self.buffers, self.notes, self.device = steps, buffers, notes, device
        self._runs = tuple(step._run for step in steps)  # (one Python call less per step and replay)

    def allocate(self) -> list[torch.Tensor]:
        """Fresh uninitialised buffers like the recorded call's."""
        device = self.device
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.buffers]

    def reshape(self, index: int, shape: tuple) -> None:
        """Make buffer ``index`` with ``shape`` (as many elements) in replays: the caller's result, shaped."""
        _, dtype = self.buffers[index]
        buffers = list(self.buffers)
        buffers[index] = (tuple(shape), dtype)
        self.buffers = tuple(buffers)

    def __call__(self, sources, buffers) -> None:
        for run in self._runs:
            run(sources, buffers)


def _extent(x: torch.Tensor) -> int:
    """Bytes from ``x``'s first element to one past its last (0 for an empty tensor)."""
    if x.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1) * x.element_size()


def _regions(kind: str, tensors) -> list[tuple[str, int, int, int]]:
    return [(kind, i, t.data_ptr(), _extent(t)) for i, t in enumerate(tensors) if isinstance(t, torch.Tensor)]


_AMBIGUOUS = object()


def _slot(address: int, regions) -> tuple | None | object:
    """``(kind, index, offset)`` of the one region holding ``address``; None when none does, ``_AMBIGUOUS`` when
    several do."""
    hits = [(kind, index, address - base) for kind, index, base, size in regions
            if base <= address < base + max(size, 1)]
    if len(hits) > 1:
        return _AMBIGUOUS
    return hits[0] if hits else None


def plan_of(recorded: Recording | None, sources, buffers=None) -> Plan | str | None:
    """The :class:`Plan` replaying ``recorded``'s launches with other ``sources`` (the caller's tensors, None allowed)
    and ``buffers`` (the tensors the call made, by default those it announced with :func:`made`: a replay makes them
    again, contiguous, in this order).

    Returns :data:`NEVER` when a launch read a tensor that is neither (the call is never replayable), and None when
    it cannot be filed now: no launch, sources overlapping in memory where a launch reads them, a buffer that is
    not contiguous, or a launch that took Triton's own path (nothing recorded to replay)."""
    if recorded is None or not recorded.launches:
        return None
    buffers = recorded.made if buffers is None else buffers
    if not all(b.is_contiguous() for b in buffers):
        return None
    regions = _regions("source", sources) + _regions("buffer", buffers)
    steps = []
    for kernel, grid, args, kwargs in recorded.launches:
        slots = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                slot = _slot(arg.data_ptr(), regions)
                if slot is None:
                    return NEVER
                if slot is _AMBIGUOUS:
                    return None
                slots.append(slot)
            else:
                slots.append(("value", arg))
        replay = _launch.replay_of(kernel, grid, *args, **kwargs)
        if replay is None:
            return None
        steps.append(Step(replay, tuple(slots)))
    device = next(t.device for t in sources if isinstance(t, torch.Tensor))
    return Plan(tuple(steps), tuple((tuple(b.shape), b.dtype) for b in buffers), dict(recorded.notes), device)
