"""What an optimizer family adds to a run beyond megatron's optimizer: the trainer, the checkpointer and the log
call these hooks (``OptimizerFamily.build`` returns them beside the optimizer) and never name an optimizer.

- checkpoints: state kept beside megatron's per-parameter state (``sharded_extras``, ``load_extras``, and the
  refusal when a checkpoint lacks it); fresh state from weights loaded without an optimizer (``from_weights``);
- the log: the LRs it reports (``log_lrs``) and the gains of each matrix for the diagnostics (``matrix_gains``);
- the loop: policy lines, observations of the diagnostics and their checkpointed state (Manifold Muon's
  auto-switches).

The default adds nothing. Importing this module imports neither megatron-core nor torch (``families.py``'s rule).
"""

from __future__ import annotations

from typing import Optional


def _first_lr(optimizer, role: Optional[str]) -> Optional[float]:
    """LR of the first param group with this MD role (None: of the first group without one that holds params)."""
    for group in optimizer.param_groups:
        if group.get("md_role") == role and (role is not None or group["params"]):
            return group["lr"]
    return None if role else optimizer.param_groups[0]["lr"]


class RunHooks:
    """Per-run behaviour a family adds; this default adds nothing."""

    def describe(self) -> list[str]:
        return []

    def observe(self, optimizer, diagnostics: dict) -> list[str]:
        return []

    def state_dict(self):
        return None

    def load_state_dict(self, state, optimizer) -> list[str]:
        return []

    # --- checkpoints ----------------------------------------------------------------------------------
    def sharded_extras(self, optimizer, *, loading: bool, layer_wise: bool) -> dict:
        """{checkpoint entry: sharded state dict} saved beside megatron's optimizer state (empty buffers when
        ``loading``)."""
        return {}

    def missing_extras(self, root, common: dict, extras: dict) -> Optional[str]:
        """Why the checkpoint at ``root`` (its common state ``common``) cannot resume these ``extras``, or None."""
        return None

    def load_extras(self, optimizer, loaded: dict) -> None:
        """Copy the loaded entries of ``sharded_extras`` into the optimizer."""

    def from_weights(self, optimizer) -> Optional[str]:
        """After weights were loaded without optimizer state: the optimizer's own state made from them, and a
        line for the log saying what that kept or changed (None: nothing to say)."""
        return None

    # --- the log -------------------------------------------------------------------------------------------
    def log_lrs(self, optimizer) -> dict[str, float]:
        return {"lr": _first_lr(optimizer, None)}

    def matrix_gains(self, optimizer) -> dict:
        """{md_key: (row gains, column gains)} of the matrices this rank's optimizer steps, for the diagnostics."""
        return {}


class MDHooks(RunHooks):
    """MD decoupling's gains (and every base's whole-matrix side state) in checkpoints and in the log."""

    KEY = "md"  # the checkpoint entry of MD's state

    def sharded_extras(self, optimizer, *, loading: bool, layer_wise: bool) -> dict:
        from megatron_md.mcore.md_checkpoint import md_sharded_state
        from megatron_md.mcore.md_locate import has_md

        if not has_md(optimizer):
            return {}
        # MD gains are not parameter-shaped: megatron does not save them, they are saved beside its state
        return {self.KEY: md_sharded_state(optimizer, loading=loading, layer_wise=layer_wise)}

    def missing_extras(self, root, common: dict, extras: dict) -> Optional[str]:
        # checkpoints written before "optimizer_extras" was recorded said "has_md"
        saved = common.get("optimizer_extras", [self.KEY] if common.get("has_md") else [])
        if self.KEY in extras and self.KEY not in saved:
            return (f"--load {root}: the checkpoint has no MD gain state (saved with another optimizer); "
                    "use --pretrained-checkpoint to start MD from its weights, or --no-load-optim")
        return None

    def load_extras(self, optimizer, loaded: dict) -> None:
        from megatron_md.mcore.md_checkpoint import load_md_state

        if self.KEY in loaded:
            load_md_state(optimizer, loaded[self.KEY])

    def from_weights(self, optimizer) -> Optional[str]:
        from megatron_md.mcore.md_checkpoint import reset_md_from_weights

        return reset_md_from_weights(optimizer)

    def log_lrs(self, optimizer) -> dict[str, float]:
        out = super().log_lrs(optimizer)
        matrix_lr = _first_lr(optimizer, "hidden") or _first_lr(optimizer, "manifold")
        if matrix_lr is not None:
            out["matrix_lr"] = matrix_lr
        return out

    def matrix_gains(self, optimizer) -> dict:
        from megatron_md.mcore.md_locate import md_optimizers

        gains = {}
        for opt in md_optimizers(optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    key = getattr(p, "md_key", None)
                    if key and opt.state.get(p):
                        gains[key] = opt.gains(p)
        return gains


class PolicyHooks(MDHooks):
    """Manifold Muon: MD's hooks (its MD groups, duals) plus its geometry policy in the loop: the policy's
    description, auto-switches and their saved state."""

    def __init__(self, policy):
        self.policy = policy

    def describe(self) -> list[str]:
        return [self.policy.describe()]

    def observe(self, optimizer, diagnostics: dict) -> list[str]:
        from megatron_md.mcore.manifold_optimizer import auto_observe

        return auto_observe(self.policy, optimizer, diagnostics)

    def state_dict(self):
        return self.policy.state_dict() if hasattr(self.policy, "switched") else None

    def load_state_dict(self, state, optimizer) -> list[str]:
        if not state or not hasattr(self.policy, "switched"):
            return []
        from megatron_md.mcore.manifold_optimizer import apply_switches

        self.policy.load_state_dict(state)
        apply_switches(self.policy, optimizer)
        return [f"(restored) {line}" for line in self.policy.log]
