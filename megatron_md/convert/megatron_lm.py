"""``megatron-md convert megatron-lm``: a Megatron-LM ``torch_dist`` GPT checkpoint as ours, with a ``run_config.yaml``.

Reading the layout and comparing architectures is ``training/checkpoints/megatron_lm.py``'s (which the trainer uses
to load such a checkpoint directly); this module writes the converted copy: the weights, iteration 0 of a
``run_config.yaml`` derived from the saved ``args``, and a ``checksums.json``.
"""

from __future__ import annotations

from pathlib import Path

from megatron_md.training.checkpoints.megatron_lm import (HINTS, LATEST, SOURCE, checkpoint_arch, differences, find,
                                                         saved_arg)

# Settings Megatron-LM's args give that are no part of a run_config.yaml's model or schedule: paths of that
# cluster, launch and profiling settings.
_NOT_CARRIED = {"nproc_per_node", "device", "exit_interval", "exit_duration_in_mins", "exit_signal_handler", "profile",
                "profile_step_start", "profile_step_end", "profile_ranks", "group_query_attention"}
_UNSUPPORTED = ("multi_latent_attention", "mtp_num_layers", "hybrid_layer_pattern",
                "rotary_interleaved", "use_rope_scaling", "rotary_seq_len_interpolation_factor")


def config_from_args(args):
    """(our RunConfig, notes) for a Megatron-LM checkpoint's ``args``: the shared flags' values by their dest
    names (megatron_md's field names), Megatron-LM's conventions translated (query groups, biases, the MoE
    layer pattern, the padded vocabulary), the data paths left out. ValueError for an architecture that
    megatron_md does not build."""
    from megatron_md.training.config import FIELDS, RunConfig, apply_overrides

    arch = checkpoint_arch(args)
    bad = [f"{name}: {arch[name]} ({HINTS[name]})" for name in _UNSUPPORTED if arch.get(name)]
    if arch["activation"] not in ("silu", "gelu"):
        bad.append(f"activation: {arch['activation']} ({HINTS['activation']})")
    if bad:
        raise ValueError(f"the checkpoint's model is not one megatron_md builds: {'; '.join(bad)}")
    values = {name: getattr(args, name) for name, (section, _) in FIELDS.items()
              if section in ("model", "parallel", "optimizer", "training") and name not in _NOT_CARRIED
              and getattr(args, name, None) is not None}
    values.update({k: arch[k] for k in ("num_query_groups", "kv_channels", "ffn_hidden_size", "disable_bias_linear",
                                        "position_embedding_type")})
    if arch["padded_vocab_size"]:
        values["vocab_size"] = arch["padded_vocab_size"]  # already a multiple of the divisor x TP: pads to itself
    if arch["num_experts"]:
        values["moe_ffn_hidden_size"] = arch["moe_ffn_hidden_size"]
        pattern = arch["moe_layer_freq"]
        values["moe_layer_freq"] = "1" if all(pattern) else str(pattern).replace(" ", "")
    cfg, notes = RunConfig(), []
    for name, value in values.items():
        try:
            apply_overrides(cfg, {name: value}, "Megatron-LM's args")
        except ValueError as e:
            notes.append(f"not carried: {e}")
    tok = saved_arg(args, "tokenizer_type", None)
    files = {k: saved_arg(args, k, None) for k in ("tokenizer_model", "vocab_file", "merge_file")}
    if tok == "NullTokenizer":
        cfg.data.tokenizer_type = tok
    elif tok and all(Path(v).exists() for v in files.values() if v) and any(files.values()):
        apply_overrides(cfg, {"tokenizer_type": tok, **{k: v for k, v in files.items() if v}}, "Megatron-LM's args")
    elif tok:
        notes.append(f"tokenizer {tok} not carried (its files {[v for v in files.values() if v]} are not here): "
                     "pass --tokenizer-model (and --tokenizer-type) when training on it")
    return cfg, notes


def convert(load, output, *, log=print) -> dict:
    """Write our checkpoint (weights, iteration, consumed samples, a run_config.yaml from the saved args, a
    checksums.json) of the Megatron-LM checkpoint at ``load``; one CPU process, any saved TP/PP layout."""
    import shutil

    from megatron.core import dist_checkpointing

    from megatron_md.convert.hf_export import init_single_process, shutdown
    from megatron_md.models.builder import build_model, padded_vocab_size
    from megatron_md.training.checkpoints import checkpointing as ckpt
    from megatron_md.training.checkpoints.integrity import write_manifest
    from megatron_md.training.validate import validate_for_inference

    found = find(load)
    if found is None:
        raise FileNotFoundError(f"--load {load}: no Megatron-LM torch_dist checkpoint there (a {LATEST} naming a "
                                "directory whose common state holds 'args' and 'checkpoint_version')")
    path, common = found
    args, root = common["args"], Path(output)
    cfg, notes = config_from_args(args)
    validate_for_inference(cfg)
    iteration, consumed = int(common.get("iteration", 0)), int(saved_arg(args, "consumed_train_samples", 0))
    final = ckpt.iter_dir(root, iteration)
    if (root / ckpt.LATEST).exists() or final.exists():
        raise FileExistsError(f"--output {root}: already holds a checkpoint; choose an empty directory")
    run_yaml = cfg.to_yaml()
    p = cfg.parallel  # the run config keeps the saved layout; the weights are read at TP1 PP1 (dist_checkpointing reshards)
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = p.expert_model_parallel_size = 1
    p.expert_tensor_parallel_size, p.sequence_parallel, p.use_distributed_optimizer = None, False, False
    cfg.model.transformer_impl, cfg.training.bf16 = "local", False
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    diffs = differences(args, cfg, vocab)
    if diffs:  # the translation itself missed something: say so rather than write a wrong checkpoint
        raise ValueError(f"internal: the derived config differs from the checkpoint's args: {'; '.join(diffs)}")
    init_single_process(cfg.training.seed)
    partial = final.with_name(final.name + ".partial")
    try:
        model = build_model(cfg, vocab, cpu=True, pre_process=True, post_process=True)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
        model.load_state_dict(loaded["model"])
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": iteration,
                                 "consumed_samples": consumed, "has_md": False,
                                 "extra": {"imported_from": str(path.resolve()), "megatron_lm_source": SOURCE}},
                                str(partial))
    finally:
        shutdown()
    (partial / ckpt.RUN_CONFIG).write_text(run_yaml)
    write_manifest(partial)
    partial.rename(final)
    (root / ckpt.LATEST).write_text(f"{iteration}\n")
    for note in notes:
        log(f"convert megatron-lm: {note}")
    log(f"convert megatron-lm: {path} -> {final} (iteration {iteration}, {consumed} samples consumed; optimizer "
        "and RNG state are not converted)")
    return {"path": str(final), "iteration": iteration, "consumed_samples": consumed, "notes": notes}
