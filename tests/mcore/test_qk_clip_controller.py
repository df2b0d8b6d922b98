"""QK-clip inside megatron-core, one process: for every optimizer, a clipped step against the same step unclipped
and the clip computed independently (megatron-core's own row clip, the DGram retraction, the logits recomputed
from what attention received)."""

from __future__ import annotations

import math

import pytest
import torch

SEQ, MBS = 24, 2


def _dense_head_max(q, k, scale):
    sq, b, h, d = q.shape
    kk = k.repeat_interleave(h // k.shape[2], dim=2)
    logits = scale * torch.einsum("sbhd,tbhd->bhst", q.double(), kk.double())
    logits = logits.masked_fill(torch.ones(sq, sq, dtype=torch.bool).triu(1), -math.inf)
    return logits.amax(dim=(0, 2, 3)).float()


def _batch():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 500, (MBS, SEQ + 1), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, -1)}


def _step(optimizer_name, preset, tau=None, extra=None, alpha=0.5):
    """Build, one training step on a fixed batch (clipping at ``tau`` if given); (model, optimizer, maxima, qk)
    where maxima are per layer and head, recomputed from the q and k attention received."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.utils import unwrap_model

    from megatron_md.mcore.families import family_of
    from megatron_md.mcore.qk_clip import QKClip
    from megatron_md.training.build import build_optimizer, build_wrapped_model
    from megatron_md.training.config import resolve
    from megatron_md.training.step import make_forward_step

    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    cfg = resolve(preset, None, {"optimizer": optimizer_name, "mock_data": True, "seq_length": SEQ,
                                 "micro_batch_size": MBS, "global_batch_size": MBS, "attention_backend": "local",
                                 **(extra or {})})
    model, _ = build_wrapped_model(cfg, cfg.model.vocab_size, cpu=True)
    optimizer, _ = build_optimizer(cfg, model)
    family_of(cfg).after_build(optimizer)
    qk = QKClip(model, optimizer, clip=tau is not None, threshold=tau or 1.0, alpha=alpha,
                num_layers=cfg.model.num_layers)
    gpt = unwrap_model(model)
    maxima, handles = {}, []
    for layer in gpt.decoder.layers:
        def hook(mod, args, kwargs, idx=layer.layer_number - 1):
            maxima[idx] = _dense_head_max(args[0].detach(), args[1].detach(), mod.softmax_scale)
        handles.append(layer.self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True))
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, MBS, MBS, 1, decrease_batch_size_if_needed=False)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    qk.arm(True)
    get_forward_backward_func()(forward_step_func=make_forward_step(False), data_iterator=iter([_batch()]),
                                model=[model], num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS,
                                forward_only=False)
    for h in handles:
        h.remove()
    qk.before_step()
    optimizer.step()
    qk.after_step()
    return gpt, optimizer, maxima, qk


def _params(gpt) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in gpt.named_parameters()}


def _megatron_rows(gpt, idx: int, W: torch.Tensor, head_max: torch.Tensor, tau: float) -> torch.Tensor:
    """megatron-core's own QKV row clip (SelfAttention._clip_linear_qkv; per query group, = per head for MHA)."""
    from megatron.core.transformer.attention import SelfAttention

    attn = gpt.decoder.layers[idx].self_attention
    attn.qk_clip_balancing_eta = torch.clamp(tau / head_max, max=1.0).view(-1, 1, 1)
    try:
        return SelfAttention._clip_linear_qkv(attn, W.clone())
    finally:
        del attn.qk_clip_balancing_eta


def _unclipped_and_tau(optimizer_name, preset, extra=None):
    gpt, opt, maxima, _ = _step(optimizer_name, preset, None, extra)
    allm = torch.cat(list(maxima.values()))
    return _params(gpt), opt, maxima, allm.median().item()  # about half the heads above τ


QKV = "decoder.layers.{}.self_attention.linear_qkv.weight"


@pytest.mark.parametrize("optimizer_name,extra", [("adam", {}), ("muon", {}), ("muon_md", {}), ("adam_md", {}),
                                                  ("manifold_muon", {"geometry": "all-dgram"}),
                                                  ("manifold_muon", {"geometry": "hetero"})])
def test_row_clip_without_qk_norm(mcore_world, optimizer_name, extra):
    """tiny-gpt2 (MHA, no QK-norm): the QKV rows of the heads above τ, every other weight bit for bit."""
    from megatron_md.mcore.md_locate import md_optimizers
    from megatron_md.optim.manifolds import get_geometry

    before, opt0, maxima, tau = _unclipped_and_tau(optimizer_name, "tiny-gpt2", extra)
    gpt, opt, maxima_again, qk = _step(optimizer_name, "tiny-gpt2", tau, extra)
    after = _params(gpt)
    for idx in maxima:
        torch.testing.assert_close(maxima_again[idx], maxima[idx], rtol=0, atol=0)  # the same forward
    assert qk.clipped > 0
    targets = {QKV.format(i) for i in maxima}
    for name in after:
        if name not in targets:
            assert torch.equal(after[name], before[name]), name
    geometry = extra.get("geometry")
    for idx, m in maxima.items():
        name = QKV.format(idx)
        if geometry == "hetero":  # Stiefel attention: left alone
            assert torch.equal(after[name], before[name])
            continue
        expect = _megatron_rows(gpt, idx, before[name], m, tau)
        if geometry == "all-dgram":  # scaled, then retracted onto DGram
            expect = get_geometry("dgram").retract(expect)
            G = after[name].T @ after[name]
            assert (G - torch.diag(torch.diagonal(G))).abs().max() < 1e-5 * G.diagonal().max()
        # the maxima here come from an fp64 recomputation, the probe's from megatron's fp32 scores: ulps apart
        rtol = 1e-6 if optimizer_name in ("adam", "muon") else 1e-5
        torch.testing.assert_close(after[name], expect, rtol=rtol, atol=1e-7)
        assert not torch.equal(after[name], before[name]) or (m <= tau).all()
    if optimizer_name.endswith("_md"):  # the factor went into the row gains; the directions are the same
        (md0,), (md1,) = md_optimizers(opt0), md_optimizers(opt)
        p0 = next(p for g in md0.param_groups for p in g["params"] if p.md_key.endswith("0.self_attention.linear_qkv.weight"))
        p1 = next(p for g in md1.param_groups for p in g["params"] if p.md_key == p0.md_key)
        rows = _megatron_rows(gpt, 0, torch.ones_like(before[QKV.format(0)]), maxima[0], tau)[:, 0]
        torch.testing.assert_close(md1.gains(p1)[0], md0.gains(p0)[0] * rows, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(md1.direction(p1), md0.direction(p0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer_name", ["adam", "muon_md", "manifold_muon"])
def test_norm_clip_with_qk_norm(mcore_world, optimizer_name):
    """tiny-dense (QK-norm): a row factor would be normalised away; the QK-norm weights take the layer's factor."""
    before, _, maxima, tau = _unclipped_and_tau(optimizer_name, "tiny-dense")
    gpt, _, _, qk = _step(optimizer_name, "tiny-dense", tau, alpha=0.3)
    after = _params(gpt)
    assert qk.clipped > 0
    changed = set()
    for idx, m in maxima.items():
        eta = min(tau / m.max().item(), 1.0)
        for which, power in (("q_layernorm", 0.3), ("k_layernorm", 0.7)):
            name = f"decoder.layers.{idx}.self_attention.{which}.weight"
            torch.testing.assert_close(after[name], before[name] * eta ** power, rtol=1e-6, atol=0)
            changed.add(name)
    for name in after:
        if name not in changed:
            assert torch.equal(after[name], before[name]), name


def test_logging_only_changes_nothing(mcore_world):
    """Without --qk-clip the probe only measures: the step is bit for bit the one without a probe."""
    gpt, _, maxima, qk = _step("muon_md", "tiny-gpt2", None)
    fields = qk.log_fields(torch.device("cpu"))
    assert fields["max_logit"] == pytest.approx(max(m.max().item() for m in maxima.values()), rel=1e-5)
    assert set(fields) == {"max_logit", *(f"max_logit/L{i}" for i in maxima)}
    assert qk.pending == {} and not hasattr(qk, "targets")


def test_refuses_md_without_row_gains(mcore_world):
    with pytest.raises(ValueError, match="--md-gains"):
        _step("muon_md", "tiny-gpt2", 1.0, {"md_gains": "col"})
