"""Manifold Muon's MD groups take what ``--geometry`` says of them."""

from __future__ import annotations

from megatron_md.training.config import resolve


def test_a_base_named_on_an_md_rule_reaches_its_groups(mcore_world):
    """``mlp=md:adam`` gives the MLP's MD groups the Adam base (the suffix was ignored: every MD group of a
    geometry took Muon); roles whose rule names no base keep their family defaults (attention Muon, the
    embedding Adam, the router --md-router-base)."""
    from megatron_md.mcore.md_locate import md_optimizers
    from megatron_md.optim.md import MDHyperParams
    from megatron_md.training.build import build_optimizer, build_wrapped_model

    cfg = resolve("tiny-moe", None, {"optimizer": "manifold_muon", "geometry": "md,mlp=md:adam,experts=md:adam",
                                     "mock_data": True})
    model, _ = build_wrapped_model(cfg, cfg.model.vocab_size, cpu=True)
    optimizer, _ = build_optimizer(cfg, model)
    bases = {}
    for opt in md_optimizers(optimizer):
        for group in opt.param_groups:
            if group.get("manifold", "md") != "md":
                continue
            for p in group["params"]:
                bases[p.md_key] = type(opt.base_for(MDHyperParams.from_group(group))).__name__
    assert bases["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == "AdamBase"
    assert bases["decoder.layers.0.self_attention.linear_qkv.weight"] == "MuonBase"
    assert bases["decoder.layers.0.self_attention.linear_proj.weight"] == "MuonBase"
    assert bases["embedding.word_embeddings.weight"] == "AdamBase"
    assert bases["decoder.layers.0.mlp.router.weight"] == "MuonBase"
