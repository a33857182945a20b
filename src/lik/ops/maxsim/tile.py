"""The tile loop's pieces, which live in :mod:`lik.core.tile` and :mod:`lik.core.stream`: kept under this name for
code that imports them from here.

Setting one of these names here (a test wrapping ``class_tile_max`` to count its calls under the interpreter) sets
it where the kernels look it up too, in :mod:`lik.core.tile` and :mod:`lik.core.stream`.
"""

import sys
import types

from ...core import stream as _stream
from ...core import tile as _tile
from ...core.stream import *  # noqa: F403
from ...core.tile import *  # noqa: F403

__all__ = [*_tile.__all__, *_stream.__all__]


class _PassingOn(types.ModuleType):
    def __setattr__(self, name, value):
        for module in (_tile, _stream):
            if name in vars(module):
                setattr(module, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _PassingOn
