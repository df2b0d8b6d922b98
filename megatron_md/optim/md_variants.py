"""The single-process MD optimizers, one per base update of ``bases.py``: MuonMD, AdamMD, LionMD, SoapMD,
AdEMAMixMD and NormMD (docs/optimizers.md §1). Each is ``md_optimizer.MDOptimizer`` with its base and the
base's hyperparameters as keyword arguments (their defaults are the API's; the command line's are in
docs/optimizers.md, and where they differ the class says why); the MD options of ``md_optimizer.OPTIONS``
are common to all.
"""

from __future__ import annotations

from typing import Any, Iterable

from .bases import AdamBase, AdEMAMixBase, BaseUpdate, LionBase, MuonBase, NormalizedBase, SoapBase
from .md_optimizer import MDOptimizer, md_options


def _check_lrs(lr: float, gains_lr: float) -> None:
    if lr < 0 or gains_lr < 0:
        raise ValueError(f"learning rates must be >= 0, got lr={lr}, gains_lr={gains_lr}")


def _adam_gains(betas, eps: float, gains_betas, gains_eps) -> dict:
    """The gains' Adam settings of an Adam-like base: the matrices' betas and eps unless given."""
    return {"gains_betas": tuple(gains_betas if gains_betas is not None else betas),
            "gains_eps": eps if gains_eps is None else gains_eps}


class MuonMD(MDOptimizer):
    """MD decoupling with a Muon base: momentum + Nesterov, Newton-Schulz msign, ``shape_up`` scale.

    On the flat sphere the relative direction update per step is ``lr`` for every shape (exact msign).
    Gains use Adam with ``gains_lr`` and ``gains_betas``/``gains_eps`` (the run's Adam settings).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        gains_lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        scale_mode: str = "shape_up",
        sphere: str = "flat",
        gains: str = "rowcol",
        gain_param: str = "softplus",
        weight_decay: float = 0.0,
        *,
        ns_coefficients: str = "quintic",
        gains_betas: tuple[float, float] = (0.9, 0.99),
        gains_eps: float = 1e-8,
        gains_weight_decay: float | None = None,
        qkv_split_shapes: tuple[int, int, int] | None = None,
        base: BaseUpdate | None = None,
        **options,
    ):
        _check_lrs(lr, gains_lr)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        defaults = dict(
            lr=lr, gains_lr=gains_lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            ns_coefficients=ns_coefficients, scale_mode=scale_mode, sphere=sphere, gains=gains,
            gain_param=gain_param, weight_decay=weight_decay, gains_betas=tuple(gains_betas),
            gains_eps=gains_eps, gains_weight_decay=gains_weight_decay,
            qkv_split_shapes=qkv_split_shapes, **md_options(options, gain_param),
        )
        super().__init__(params, defaults, base if base is not None else MuonBase())


class AdamMD(MDOptimizer):
    """MD decoupling with a bias-corrected Adam base on the direction gradient (no scale factor).

    Gains use the same betas/eps as the matrices unless ``gains_betas``/``gains_eps`` are given. ``betas`` default
    to (0.9, 0.99), the MD paper's launch scripts; a run from the command line takes --adam-beta1/2, which the MD
    recipe sets to (0.9, 0.95) unless given (the family's recipe, docs/optimizers.md).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        gains_lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        sphere: str = "flat",
        gains: str = "rowcol",
        gain_param: str = "softplus",
        weight_decay: float = 0.0,
        *,
        gains_betas: tuple[float, float] | None = None,
        gains_eps: float | None = None,
        gains_weight_decay: float | None = None,
        qkv_split_shapes: tuple[int, int, int] | None = None,
        base: BaseUpdate | None = None,
        **options,
    ):
        _check_lrs(lr, gains_lr)
        defaults = dict(
            lr=lr, gains_lr=gains_lr, betas=tuple(betas), eps=eps, sphere=sphere, gains=gains,
            gain_param=gain_param, weight_decay=weight_decay,
            **_adam_gains(betas, eps, gains_betas, gains_eps),
            gains_weight_decay=gains_weight_decay, qkv_split_shapes=qkv_split_shapes,
            **md_options(options, gain_param),
        )
        super().__init__(params, defaults, base if base is not None else AdamBase())


class LionMD(MDOptimizer):
    """MD decoupling with a Lion base: the sign of the interpolated momentum, scaled by ``1/sqrt(min(m, n))``
    per block so that, like MuonMD, the direction turns by ``lr`` per step on the flat sphere."""

    def __init__(self, params: Iterable[Any], lr: float, gains_lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.99), *, gains_betas: tuple[float, float] = (0.9, 0.99),
                 gains_eps: float = 1e-8, **options):
        _check_lrs(lr, gains_lr)
        defaults = dict(lr=lr, gains_lr=gains_lr, lion_betas=tuple(betas), gains_betas=tuple(gains_betas),
                        gains_eps=gains_eps, **md_options(options))
        super().__init__(params, defaults, LionBase())


class SoapMD(MDOptimizer):
    """MD decoupling with a SOAP base (emerging-optimizers' Kronecker factors and eigenbasis, Adam inside).

    ``betas`` default to (0.9, 0.95), not AdamMD's (0.9, 0.99): they are emerging-optimizers' SOAP defaults, kept
    so this class steps as that SOAP would inside MD. On the command line both take --adam-beta1/2 (the MD
    recipe's 0.95 for beta2)."""

    def __init__(self, params: Iterable[Any], lr: float, gains_lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, shampoo_beta: float = 0.95,
                 *, gains_betas: tuple[float, float] = (0.9, 0.99), gains_eps: float = 1e-8, **options):
        _check_lrs(lr, gains_lr)
        defaults = dict(lr=lr, gains_lr=gains_lr, betas=tuple(betas), eps=eps, soap_shampoo_beta=shampoo_beta,
                        gains_betas=tuple(gains_betas), gains_eps=gains_eps, **md_options(options))
        super().__init__(params, defaults, SoapBase())


class AdEMAMixMD(MDOptimizer):
    """MD decoupling with an AdEMAMix base: Adam plus a slow EMA of the direction gradient added with weight
    ``alpha`` (``beta3``; both can warm up over base steps, 0 = off). Gains use the matrices' betas and eps
    unless ``gains_betas``/``gains_eps`` are given, as in AdamMD."""

    def __init__(self, params: Iterable[Any], lr: float, gains_lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8, beta3: float = 0.999,
                 alpha: float = 5.0, beta3_warmup: int = 0, alpha_warmup: int = 0, *,
                 gains_betas: tuple[float, float] | None = None, gains_eps: float | None = None, **options):
        _check_lrs(lr, gains_lr)
        defaults = dict(
            lr=lr, gains_lr=gains_lr, betas=tuple(betas), eps=eps, ademamix_beta3=beta3, ademamix_alpha=alpha,
            ademamix_beta3_warmup=beta3_warmup, ademamix_alpha_warmup=alpha_warmup,
            **_adam_gains(betas, eps, gains_betas, gains_eps), **md_options(options),
        )
        super().__init__(params, defaults, AdEMAMixBase())


class NormMD(MDOptimizer):
    """MD decoupling with the normalised-momentum base: MuonMD with each block of the (Nesterov) momentum put on
    the direction's sphere instead of orthogonalised, then scaled by ``scale_mode`` like msign."""

    def __init__(self, params: Iterable[Any], lr: float, gains_lr: float = 1e-3, momentum: float = 0.95,
                 nesterov: bool = True, scale_mode: str = "shape_up", *,
                 gains_betas: tuple[float, float] = (0.9, 0.99), gains_eps: float = 1e-8, **options):
        _check_lrs(lr, gains_lr)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        defaults = dict(lr=lr, gains_lr=gains_lr, momentum=momentum, nesterov=nesterov, scale_mode=scale_mode,
                        gains_betas=tuple(gains_betas), gains_eps=gains_eps, **md_options(options))
        super().__init__(params, defaults, NormalizedBase())
