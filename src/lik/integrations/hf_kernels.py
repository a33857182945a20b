"""lik through Hugging Face's ``kernels`` package: transformers' ``MultiScaleDeformableAttention`` layers (Deformable
DETR, RT-DETR, Grounding DINO...) pick lik's deformable attention by kernel mapping, without patching anything.

transformers marks those layers ``@use_kernel_forward_from_hub("MultiScaleDeformableAttention")``; ``kernels``'
:func:`kernelize` then replaces each such layer's ``forward`` with the ``forward`` of the layer class its mapping
names. The class here is :class:`lik.MultiScaleDeformableAttention` (stateless, the same forward signature, and the
``has_backward`` / ``can_torch_compile`` flags ``kernels`` reads), reached three ways, all offline:

* :class:`LikLayerRepository`, a repository object for ``kernels.register_kernel_mapping`` /
  ``kernels.use_kernel_mapping`` (:func:`kernel_mapping` builds the whole mapping);
* :func:`local_repository`, a directory in ``kernels``' local-kernel layout whose module imports lik's layers, for
  ``kernels.LocalLayerRepository`` and transformers' ``KernelConfig(..., use_local_kernel=True)``;
* :data:`layers`, the ``layers`` namespace a kernel module exposes.

Nothing here imports ``kernels`` or transformers at import time. The ``kernels`` package is needed only to run
``kernelize`` (``pip install kernels``).

Example:
    >>> from kernels import Mode, kernelize, use_kernel_mapping
    >>> from lik.integrations.hf_kernels import kernel_mapping
    >>> with use_kernel_mapping(kernel_mapping()):
    ...     model = kernelize(model, mode=Mode.TRAINING, device="cuda")   # its deformable layers run lik
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from .transformers import MultiScaleDeformableAttention

__all__ = ["LAYER_NAME", "layers", "LikLayerRepository", "kernel_mapping", "local_repository"]

LAYER_NAME = "MultiScaleDeformableAttention"  # the name transformers registers its layers under


class layers:  # noqa: N801 (a kernel module's ``layers`` namespace is lower case)
    """The ``layers`` namespace of a ``kernels`` kernel module: the layer classes a mapping may name."""

    MultiScaleDeformableAttention = MultiScaleDeformableAttention


class LikLayerRepository:
    """A ``kernels`` repository (its ``RepositoryProtocol``: ``load()`` returns the layer class) serving lik's
    layers from the installed package: no Hub, no download, no directory.

    Args:
        layer_name: a class of :data:`layers` (``"MultiScaleDeformableAttention"``).

    Example:
        >>> kernels.register_kernel_mapping({"MultiScaleDeformableAttention": {"cuda": LikLayerRepository()}})
    """

    def __init__(self, layer_name: str = LAYER_NAME):
        if not isinstance(layer_name, str):
            raise TypeError(f"layer_name must be a str, got {type(layer_name).__name__}")
        if not hasattr(layers, layer_name) or layer_name.startswith("_"):
            raise ValueError(f"layer_name {layer_name!r} is not a lik layer; lik has {LAYER_NAME!r}")
        self.layer_name = layer_name

    def load(self) -> type[torch.nn.Module]:
        return getattr(layers, self.layer_name)

    def __eq__(self, other) -> bool:
        return isinstance(other, LikLayerRepository) and other.layer_name == self.layer_name

    def __hash__(self) -> int:
        return hash(("lik", self.layer_name))

    def __str__(self) -> str:
        return f"lik (layer `{self.layer_name}`)"

    __repr__ = __str__


_DEVICE_TYPES = ("cuda", "cpu", "rocm")


def kernel_mapping(devices=("cuda", "cpu")) -> dict:
    """The mapping for ``kernels.register_kernel_mapping`` / ``kernels.use_kernel_mapping``: transformers'
    ``MultiScaleDeformableAttention`` to lik's layer on each device type in ``devices`` (CUDA runs the Triton
    kernels; CPU the PyTorch reference, or the kernels under ``TRITON_INTERPRET=1``).

    Example:
        >>> kernel_mapping()
        {'MultiScaleDeformableAttention': {'cuda': lik (layer `MultiScaleDeformableAttention`), 'cpu': ...}}
    """
    if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
        raise TypeError(f"devices must be a sequence of device type names, got {devices!r}")
    unknown = [d for d in devices if d not in _DEVICE_TYPES]
    if unknown:
        raise ValueError(f"devices: {unknown} not among {_DEVICE_TYPES}")
    return {LAYER_NAME: {device: LikLayerRepository() for device in devices}}


_MODULE_SOURCE = '''"""A kernels local repository serving lik's layers (written by lik.integrations.hf_kernels)."""

from lik.integrations.hf_kernels import layers  # noqa: F401
'''


def local_repository(path: str | os.PathLike | None = None) -> Path:
    """Write (or refresh) a ``kernels`` local kernel repository whose module is lik's :data:`layers`, and return its
    path: ``metadata.json`` (name ``lik-msda``, the backend of this PyTorch build) and an ``__init__.py`` that
    imports lik. Default location: ``lik-hf-kernels`` in the temporary directory.

    Use it with ``kernels.LocalLayerRepository(repo_path=path, layer_name="MultiScaleDeformableAttention")`` or
    with transformers' kernel config::

        path = local_repository()
        config = KernelConfig({"MultiScaleDeformableAttention": f"{path}:MultiScaleDeformableAttention"},
                              use_local_kernel=True)
        model = DeformableDetrForObjectDetection.from_pretrained(..., use_kernels=True, kernel_config=config)
    """
    root = Path(path) if path is not None else Path(tempfile.gettempdir()) / "lik-hf-kernels"
    root.mkdir(parents=True, exist_ok=True)
    backend = "cuda" if torch.version.cuda else "rocm" if getattr(torch.version, "hip", None) else "cpu"
    metadata = {"id": "lik-msda", "name": "lik-msda", "version": 1, "license": "Apache-2.0", "python-depends": [],
                "backend": {"type": backend}}
    for name, text in (("metadata.json", json.dumps(metadata, indent=2) + "\n"), ("__init__.py", _MODULE_SOURCE)):
        target = root / name
        if not target.exists() or target.read_text() != text:
            scratch = root / f".{name}.{os.getpid()}"
            scratch.write_text(text)
            os.replace(scratch, target)  # atomic: a concurrent reader sees the old file or the new one
    return root
