"""Optimizers of megatron_md: Magnitude-Direction decoupling (MuonMD, AdamMD, LionMD, SoapMD, AdEMAMixMD,
NormMD), module-wise Manifold Muon (ManifoldMuon, ``manifolds``), the geometry policy, and their building blocks.

Pure torch (no megatron, no torch.distributed): tensor-parallel glue plugs in through ``Reducer`` and
``MDOptimizer.reducer_for`` / ``orthogonalizer_for``.
"""

from .md import MDHyperParams, md_step_
from .gains import gain_param
from .blocks import qkv_row_index
from .sphere import Reducer, project_
from .msign import msign, scale_factor
from .bases import BASES, AdamBase, AdEMAMixBase, BaseUpdate, LionBase, MuonBase, NormalizedBase, SoapBase
from .md_optimizer import MDOptimizer
from .md_variants import AdamMD, AdEMAMixMD, LionMD, MuonMD, NormMD, SoapMD
from . import manifolds
from .manifold_muon import ManifoldHyperParams, ManifoldMuon, manifold_step_
from .policy import (
    GEOMETRIES,
    PRESETS,
    ROLES,
    Assignment,
    AutoPolicy,
    GeometryPolicy,
    layer_of,
    make_policy,
    role_of,
)

__all__ = [
    "AdamBase",
    "AdamMD",
    "AdEMAMixBase",
    "AdEMAMixMD",
    "NormalizedBase",
    "NormMD",
    "BASES",
    "LionBase",
    "LionMD",
    "SoapBase",
    "SoapMD",
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
    # Module-wise Manifold Muon and the geometry policy
    "manifolds",
    "ManifoldHyperParams",
    "ManifoldMuon",
    "manifold_step_",
    "GEOMETRIES",
    "PRESETS",
    "ROLES",
    "Assignment",
    "AutoPolicy",
    "GeometryPolicy",
    "layer_of",
    "make_policy",
    "role_of",
]
