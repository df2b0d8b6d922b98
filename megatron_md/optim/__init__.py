"""Optimizers of megatron_md: Magnitude-Direction decoupling (MuonMD, AdamMD) and their building blocks.

Pure torch (no megatron, no torch.distributed): tensor-parallel glue plugs in through ``Reducer`` and
``MDOptimizer.reducer_for`` / ``orthogonalizer_for``.
"""

from .md import (
    AdamBase,
    BaseUpdate,
    MDHyperParams,
    MuonBase,
    Reducer,
    gain_param,
    md_step_,
    project_,
    qkv_row_index,
)
from .msign import msign, scale_factor
from .muon_md import AdamMD, MDOptimizer, MuonMD

__all__ = [
    "AdamBase",
    "AdamMD",
    "BaseUpdate",
    "MDHyperParams",
    "MDOptimizer",
    "MuonBase",
    "MuonMD",
    "Reducer",
    "gain_param",
    "md_step_",
    "msign",
    "project_",
    "qkv_row_index",
    "scale_factor",
]
