"""muon_md inside megatron-core (one process): which module gets which MD treatment."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_md.training.config import resolve


@pytest.fixture
def md_model(mcore_world):
    from megatron_md.training.build import build_optimizer, build_wrapped_model

    cfg = resolve("tiny-moe", None, {"optimizer": "muon_md", "mock_data": True, "matrix_lr": 0.05,
                                     "embedding_lr": 0.003, "lr": 0.001, "gains_lr": 0.002})
    model, _ = build_wrapped_model(cfg, cfg.model.vocab_size, cpu=True)
    optimizer, scheduler = build_optimizer(cfg, model)
    return cfg, model, optimizer


def _md_params(optimizer):
    from megatron_md.mcore.md_locate import md_optimizers

    out = {}
    for opt in md_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                out[p.md_key] = (group, p, opt)
    return out


def test_routing_follows_the_paper(md_model):
    cfg, model, optimizer = md_model
    md = _md_params(optimizer)
    names = dict(model.module.named_parameters())
    for name, p in names.items():
        routed_to_md = name in md
        assert routed_to_md == (p.ndim == 2), name  # norms (1-D) stay with AdamW
    qkv = md["decoder.layers.0.self_attention.linear_qkv.weight"][0]
    assert (qkv["sphere"], qkv["gains"], qkv["md_base"], qkv["max_lr"]) == ("flat", "rowcol", "muon", 0.05)
    expert = md["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"][0]
    assert expert["sphere"] == "flat" and expert["md_base"] == "muon"
    router = md["decoder.layers.0.mlp.router.weight"][0]
    assert (router["sphere"], router["scale_mode"]) == ("row", "shape_scaling")
    emb = md["embedding.word_embeddings.weight"][0]
    assert (emb["sphere"], emb["gains"], emb["md_base"], emb["max_lr"]) == ("row", "none", "adam", 0.003)
    head = md["output_layer.weight"][0]
    assert (head["sphere"], head["md_base"], head["max_lr"]) == ("row", "adam", 0.001)
    assert qkv["gains_max_lr"] == 0.002


def test_weights_start_on_their_spheres_with_unit_gains(md_model):
    _, _, optimizer = md_model
    for key, (group, p, opt) in _md_params(optimizer).items():
        W = p.detach().float()
        if group["sphere"] == "row":
            assert torch.allclose(W.norm(dim=1), torch.ones(W.shape[0]), rtol=1e-5), key
        elif "linear_qkv" not in key:  # QKV: per-block radii, covered in tests/optim
            assert W.norm().item() == pytest.approx(math.sqrt(max(W.shape)), rel=1e-5), key
        g_row, g_col = opt.gains(p)
        for g in (g_row, g_col):
            if g is not None:
                assert torch.equal(g, torch.ones_like(g)), key


def test_md_recipe_is_the_default_for_muon_md():
    cfg = resolve("tiny-dense", None, {"optimizer": "muon_md"})
    o = cfg.optimizer
    assert (o.weight_decay, o.lr_warmup_iters, o.lr_decay_style, o.clip_grad) == (0.0, 0, "linear", 1.0)
    cfg = resolve("tiny-dense", None, {"optimizer": "muon_md", "lr_warmup_iters": 5})
    assert cfg.optimizer.lr_warmup_iters == 5  # explicit settings win
    assert resolve("tiny-dense", None, {"optimizer": "adam"}).optimizer.weight_decay == 0.01


def test_out_projection_radius_option(mcore_world):
    from megatron_md.training.build import build_optimizer, build_wrapped_model

    cfg = resolve("tiny-dense", None, {"optimizer": "muon_md", "mock_data": True, "md_out_proj_radius": True})
    model, _ = build_wrapped_model(cfg, cfg.model.vocab_size, cpu=True)
    optimizer, _ = build_optimizer(cfg, model)
    md = _md_params(optimizer)
    scale = 1.0 / math.sqrt(2 * cfg.model.num_layers)
    for key, (group, p, _) in md.items():
        W = p.detach().float()
        if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert group["radius_scale"] == pytest.approx(scale)
            assert W.norm().item() == pytest.approx(scale * math.sqrt(max(W.shape)), rel=1e-5), key
        elif key.endswith("linear_fc1.weight"):
            assert group.get("radius_scale", 1.0) == 1.0
            assert W.norm().item() == pytest.approx(math.sqrt(max(W.shape)), rel=1e-5), key


def test_md_optimizer_names_agree():
    """The MD family's one list of optimizers covers every base update, and is what megatron's registry gets."""
    from megatron_md.mcore.families import MD_OPTIMIZERS, MDFamily
    from megatron_md.optim.bases import BASES

    assert tuple(MDFamily.BASES) == MD_OPTIMIZERS and set(MDFamily.BASES.values()) == set(BASES)


def test_embed_mode_and_preserve_init_route_by_role(mcore_world):
    """``embed``: out-projections get column spheres and gains, the other hidden matrices row ones; with
    ``--md-preserve-init`` the hidden weights are the model's initial ones and the gains hold their norms."""
    from megatron_md.training.build import build_optimizer, build_wrapped_model

    cfg = resolve("tiny-dense", None, {"optimizer": "lion_md", "mock_data": True, "md_sphere": "embed",
                                       "md_gains": "embed", "md_preserve_init": True})
    model, _ = build_wrapped_model(cfg, cfg.model.vocab_size, cpu=True)
    initial = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    optimizer, _ = build_optimizer(cfg, model)
    md = _md_params(optimizer)
    seen = set()
    for key, (group, p, opt) in md.items():
        if "decoder.layers." not in key:
            continue
        out_proj = key.endswith(("linear_proj.weight", "linear_fc2.weight"))
        assert bool(group.get("out_proj")) == out_proj and group["md_base"] == "lion", key
        assert torch.equal(p.detach(), initial[key]), f"{key}: preserve_init must keep the weights"
        opt._init_group(group, skip_non_grad_params=False)  # state is made lazily (as before a checkpoint load)
        g_row, g_col = opt.gains(p)
        axis = 0 if out_proj else 1  # out-projections: unit columns, the others unit rows
        norms = p.detach().float().norm(dim=axis)
        torch.testing.assert_close((g_col if out_proj else g_row), norms, rtol=1e-5, atol=0)
        assert (g_row is None) == out_proj and (g_col is None) != out_proj
        seen.add(out_proj)
    assert seen == {True, False}


def test_authors_options_reach_their_groups(mcore_world):
    """The flags of the authors' options land in the MD groups they are meant for: geometry and split gains on
    hidden matrices only, the routing switches on the router, embedding and head, the LR bands as asked."""
    from megatron_md.training.build import build_optimizer, build_wrapped_model

    cfg = resolve("tiny-moe", None, {
        "optimizer": "ademamix_md", "mock_data": True, "lr": 0.001, "min_lr": 1e-5, "output_lr": 0.004,
        "min_lr_mode": "absolute", "md_sphere_kind": "spectral", "md_split_heads": True, "md_split_qkv_gains": True,
        "md_gains_min": 0.01, "md_gains_beta1": 0.7, "md_gains_eps": 1e-10, "md_embedding_sphere": "col",
        "md_embedding_gains": "row", "md_embeddings_base": "muon", "md_router_base": "adam", "ademamix_alpha": 3.0})
    model, _ = build_wrapped_model(cfg, cfg.model.vocab_size, cpu=True)
    optimizer, _ = build_optimizer(cfg, model)
    groups = {key: g for key, (g, _, _) in _md_params(optimizer).items()}
    qkv = next(g for k, g in groups.items() if k.endswith("linear_qkv.weight"))
    router = next(g for k, g in groups.items() if k.endswith("router.weight"))
    emb = next(g for k, g in groups.items() if k.endswith("word_embeddings.weight"))
    head = next(g for k, g in groups.items() if k.endswith("output_layer.weight"))
    assert (qkv["md_base"], qkv["sphere_kind"], qkv["split_heads"], qkv["split_qkv_gains"]) == (
        "ademamix", "spectral", True, True)
    assert (qkv["gains_min"], qkv["gains_betas"][0], qkv["gains_eps"], qkv["ademamix_alpha"]) == (0.01, 0.7, 1e-10, 3.0)
    assert router["md_base"] == "adam" and router.get("sphere_kind", "l2") == "l2" and not router.get("split_heads")
    assert (emb["sphere"], emb["gains"], emb["md_base"]) == ("col", "row", "muon")
    assert (head["md_base"], head["max_lr"], head["min_lr"], qkv["min_lr"]) == ("muon", 0.004, 1e-5, 1e-5)
