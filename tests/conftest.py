"""Shared fixtures: a single-process megatron-core world on the CPU runtime."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


TE_KERNEL_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture(autouse=True)
def _te_kernel_variables():
    """megatron-core sets Transformer Engine's NVTE_*_ATTN variables process-wide on every model build and asserts
    that later builds agree: put them back after each test, so one test's attention backend cannot fail the
    next test's build in the same process."""
    saved = {name: os.environ.get(name) for name in TE_KERNEL_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ----------------------------------------------------------------------------- how commands run
# run_cli (tests/mdtest.py) runs `megatron-md train` and the other in-process commands in persistent gloo worlds
# started once per pytest run (tests/harness/pool.py), unless the test is marked e2e or the run is given
# --launch=cli: then every command goes through `python -m megatron_md.cli` and torchrun, as a user runs it.

def pytest_addoption(parser):
    parser.addoption("--launch", choices=("pool", "cli"), default="pool",
                     help="pool (default): run megatron-md commands in persistent gloo worlds, except in tests "
                          "marked e2e; cli: run every command through the real CLI and torchrun")


@pytest.fixture(scope="session", autouse=True)
def _pool_and_shared_dirs(tmp_path_factory):
    """The pool's job files and the shared baselines go in this run's temp dir; the pool ends with the run."""
    from harness import shared
    from harness.pool import POOL

    base = tmp_path_factory.getbasetemp()
    POOL.set_root(base / "pool")
    shared.ROOT = base / "shared"
    yield
    POOL.close()


def pytest_sessionfinish(session):
    """A pooled job that left a global of megatron or megatron_md changed (tests/harness/reset.py's audit) fails the
    run, whichever tests ran: the next job in that world may have computed something else than a fresh process."""
    from harness.pool import POOL

    if POOL.audit() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    import mdtest

    mdtest.LAUNCH = config.getoption("--launch")  # what fixtures of a wider scope run with, too


@pytest.fixture(autouse=True)
def _launch_mode(request):
    import mdtest

    default = request.config.getoption("--launch")
    mdtest.LAUNCH = "cli" if request.node.get_closest_marker("e2e") is not None else default
    yield
    mdtest.LAUNCH = default


def pytest_terminal_summary(terminalreporter):
    from harness import shared
    from harness.pool import POOL

    lines = [POOL.summary(), shared.summary()]
    for line in filter(None, lines):
        terminalreporter.write_line(line)
    for job, found in POOL.audit():
        terminalreporter.write_line(f"pool audit FAILED after `{job[:200]}`: {'; '.join(found)}", red=True)


@pytest.fixture
def mcore_world():
    """Yield after init of a world-1 gloo group, model-parallel state and seeds; tear down after."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_md.runtime import activate, cpu, select_runtime
    from megatron_md.runtime.distributed import destroy_distributed, init_distributed

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(k, None)
    rt = select_runtime("cpu")
    activate(rt)
    init_distributed(rt)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    try:
        yield rt
    finally:
        ps.destroy_model_parallel()
        destroy_distributed()
        cpu.uninstall()


# ----------------------------------------------------------------------------- test tiers
# `make test` is the quick tier (-m "not slow and not full"): every cheap test plus ONE case of each family of
# expensive ones (multi-rank runs, long single-process solves, real sweeps and preprocessing). `make test-all`
# (what CI runs) adds the cases below, marked `full` here. Each entry is a test function and the one
# parametrised case of it that stays in the quick tier (None: the whole function is full-only, because another
# test of its family is the quick tier's representative, named in the comment).
FULL_ONLY: dict[str, str | None] = {
    # distributed optimizer, bf16, save and resume: kept muon_md same-layout resume
    "tests/training/checkpoints/test_distributed_resume.py::test_same_layout_resume_is_bit_identical": "muon_md",
    "tests/training/checkpoints/test_distributed_resume.py::test_resume_at_another_layout": None,
    "tests/training/checkpoints/test_distributed_resume.py::test_moe_state_survives_ep2_to_ep1_bit_for_bit": None,
    "tests/training/checkpoints/test_distributed_resume.py::test_state_survives_a_tp2_reshard_bit_for_bit": None,
    "tests/training/checkpoints/test_distributed_resume.py::test_dp_reshardable_adam_at_another_tp_is_refused": None,
    # QK-clip on two ranks: kept TP2 muon_md and the byte-sharded Adam's bf16 resume
    "tests/mcore/test_qk_clip_layouts.py::test_tensor_parallel_clips_like_one_rank": "muon_md-rows",
    "tests/mcore/test_qk_clip_layouts.py::test_distributed_optimizer_bf16_resume_is_bit_identical": "adam-rows",
    # MD across layouts: kept test_moe_expert_parallel
    "tests/mcore/test_md_layouts.py::test_dense_tp_pp_dp_and_resume_across_dp_change": None,
    "tests/mcore/test_md_layouts.py::test_layer_wise_distributed_optimizer": None,
    "tests/mcore/test_md_layouts.py::test_lion_base_with_the_authors_options_is_tp_independent": None,
    # Manifold Muon across layouts: kept test_stiefel_pins_attention_sigma_dgram_lets_it_grow
    "tests/mcore/test_manifold_layouts.py::test_pp2_resume_and_layer_wise_distributed_optimizer": None,
    "tests/mcore/test_manifold_layouts.py::test_tp2_and_ep2_match_one_rank": None,
    # orthogonalisation engine: kept TP2 muon_md
    "tests/parallel/test_engine_layouts.py::test_engine_matches_duplicated": "tp2-muon_md",
    # loss parity across layouts: kept test_moe_expert_parallel_agrees (and runtime's dense TP2 = TP1)
    "tests/training/test_layouts.py::test_dense_layouts_agree": None,
    "tests/training/test_layouts.py::test_four_rank_combinations": None,
    "tests/training/test_layouts.py::test_optimizer_variants_are_layout_independent": None,
    # Hugging Face: kept test_generate_matches_transformers_greedy_decoding (export, then transformers)
    "tests/convert/test_hf_convert.py::test_dense_export_logits_and_tokenizer": None,
    "tests/convert/test_hf_convert.py::test_import_export_round_trip_and_continue_training": None,
    "tests/convert/test_hf_convert.py::test_import_llama_made_by_transformers": None,
    # HF MoE import: one family in the quick tier (Qwen3-MoE), the others and the other router in the full one
    "tests/convert/test_hf_import.py::test_moe_import_matches_transformers_at_tp1_and_tp2_ep2": "qwen3_moe",
    # a plugin base: its choices everywhere in the quick tier; its DP2 bf16 resume (three torchrun runs) in the full one
    "tests/test_plugins.py::test_a_plugin_base_trains_and_resumes_bit_for_bit": None,
    "tests/test_plugins.py::test_a_plugin_base_trains_at_tp2_as_at_tp1": None,
    # the compiled big-matrix pass: its kernels compile for seconds; the rowcol case stays quick
    "tests/optim/test_md_batched.py::test_a_big_matrix_takes_one_compiled_pass_equal_to_the_eager_ones": "rowcol-decay",
    # the walk over MD option pairs: one pair in the quick tier, the other 90 in the full one
    "tests/mcore/test_option_combinations.py::test_option_pair_is_refused_up_front_or_reaches_its_groups":
        "muon_md-md_sphere-md_gains",
    # Megatron-LM checkpoints: the weights load and the refusals are quick; Adam's state resumes in the full tier
    "tests/training/checkpoints/test_megatron_lm.py::test_load_continues_with_adam_state_bit_for_bit": None,
    # manifold solves: kept the QKV DGram cold step and the fast end-to-end run
    "tests/optim/test_manifolds.py::test_fast_mode_cold_step_keeps_the_constraint": "qkv-dgram",
    "tests/optim/test_manifolds.py::test_fast_mode_accuracy_against_faithful": None,
    "tests/optim/test_manifolds.py::test_manifold_muon_end_to_end_keeps_constraints": "fast",
    "tests/optim/test_manifolds.py::test_more_dual_steps_reduce_violation_and_early_stop": "stiefel-ks0",
    # LR sweeps: kept test_diverged_cell_is_recorded_once (real cells through the sweep runner)
    "tests/sweep/test_lr_sweep_runs.py::test_coord_check_writes_one_row_per_optimizer_width_layer_step": None,
    "tests/sweep/test_lr_sweep_runs.py::test_extend_edges_runs_until_the_optimum_is_inside": None,
    "tests/sweep/test_lr_sweep_runs.py::test_jobs_run_cells_at_once_and_leave_a_cell_another_sweep_runs_alone": None,
    "tests/sweep/test_lr_sweep_runs.py::test_resume_cells_continues_a_stopped_cell_from_its_checkpoint_bit_for_bit":
        None,
    "tests/sweep/test_lr_sweep_runs.py::test_tiny_sweep_resumes_after_interruption_and_writes_csv_and_png": None,
    # data tools: kept test_preprocess_cli and test_gpt2_and_hf_preprocess_write_the_same_tokens
    "tests/tools/test_preprocess.py::test_preprocess_workers_xz_txt_same_output": None,
    "tests/tools/test_preprocess.py::test_train_tokenizer_cli": None,
    "tests/training/data/test_tokenizers.py::test_hf_export_writes_the_tokenizer_and_import_trains_on_with_it": None,
    "tests/training/data/test_tokenizers.py::test_train_score_generate_with_the_hf_tokenizer": None,
    # checkpoint integrity: kept test_two_ranks_share_the_hashing_and_both_raise
    "tests/training/checkpoints/test_integrity.py::test_cli_refuses_a_corrupted_checkpoint_and_the_flag_skips_the_check":
        None,
    # knobs: kept test_exit_duration_saves_and_exits_cleanly
    "tests/training/test_knobs.py::test_overlap_matches_and_async_save_resumes_bit_identically": None,
    "tests/training/test_knobs.py::test_rampup_profile_and_throughput_report": None,
    "tests/training/test_knobs.py::test_moe_knobs_train_and_log_their_losses": None,
    # process knobs: kept the per-token loss at DP2 (the gc/deterministic run is the file's e2e case)
    "tests/training/test_housekeeping.py::test_gc_deterministic_and_memory_knobs_change_no_number_and_say_what_is_on":
        None,
    # MoE router options at EP2: kept the muon_md resume (the adam case is the file's e2e run)
    "tests/training/test_moe_router.py::test_router_options_train_and_resume_bit_identically_at_ep2": "muon_md",
    "tests/training/test_moe_router.py::test_dense_first_layers_train_and_resume_bit_identically_at_ep2": None,
    # Megatron-LM's example scripts shrunk: kept GPT-3 at TP2 (Mixtral at EP2 and the Llama-3 CLI run are full-only)
    "tests/training/test_megatron_compat.py::test_megatron_lm_example_scripts_run_shrunk_and_build_megatron_lm_s_model":
        "gpt3-175b",
    "tests/training/test_megatron_compat.py::test_llama3_script_through_the_cli_with_sample_based_schedule": None,
    # the DataLoader pipeline: kept the TP2 reader/broadcast probe
    "tests/training/data/test_loader.py::test_one_reader_per_tp_group_and_every_rank_gets_its_batches": "tp2-2",
    "tests/training/data/test_loader.py::test_workers_change_no_number_and_evaluations_move_through_the_split": None,
    "tests/training/data/test_loader.py::test_document_switches_change_what_is_trained_on": None,
    "tests/training/data/test_loader.py::test_per_split_paths_replace_data_path_and_split": None,
    # timers: kept the TP2 levels (PP2 and the CLI's --timing-log-option all are full-only)
    "tests/training/observability/test_timers.py::test_levels_add_timers_to_the_log_and_metrics_and_change_no_number":
        "tp2-muon_md",
    "tests/training/observability/test_timers.py::test_every_rank_through_the_cli": None,
    # preemption: kept SIGTERM with the distributed optimizer in bf16
    "tests/training/checkpoints/test_preemption.py::test_sigterm_saves_exits_0_and_the_relaunch_continues_identically":
        "muon_md-distopt-bf16",
    "tests/training/checkpoints/test_preemption.py::test_kill_during_a_save_leaves_the_previous_checkpoint_loadable":
        None,
    # single-rank resume: kept test_resume_is_bit_identical
    "tests/training/checkpoints/test_resume.py::test_nan_step_is_skipped_and_never_saved": None,
    "tests/training/checkpoints/test_resume.py::test_score_reproduces_eval_loss": None,
    # shipped recipes through a checkpoint: kept the largest dense recipe, shrunk
    "tests/training/test_recipes.py::test_recipe_resumes_bit_identically": "md_paper/dense-1.29b_muon_md.yaml",
    # attention kernels through training runs: kept the local-to-sdpa resume
    "tests/models/test_attention.py::test_twenty_fp32_steps_match_the_local_backend": None,
    # install resolution: kept the NGC-container cases and the wheel
    "tests/test_install.py::test_this_environment_keeps_its_torch": None,
    "tests/test_install.py::test_pypi_te_wheels_stay": None,
    "tests/test_install.py::test_control_a_newer_te_would_replace_the_containers": None,
    # the pooled worlds: the quick tier keeps none (every run's pooled jobs are audited, and an audit finding fails
    # the run: conftest.pytest_sessionfinish); make test-all proves the reset and the crash handling
    "tests/harness/test_pool.py::test_a_reused_world_runs_a_case_bit_identically_to_a_fresh_one": None,
    "tests/harness/test_pool.py::test_a_rank_that_raises_ends_its_world_and_the_next_job_gets_a_new_one": None,
    # --log-update-norms: the quick tier keeps its refusal; the TP2 x EP2 comparison (three runs) is full-only
    "tests/training/observability/test_diagnostics.py::test_update_norms_at_tp2_ep2_match_one_rank_and_leave_training_alone":
        None,
    # SLURM smoke step run for real: kept test_smoke_step_runs_on_every_node_then_the_run_starts
    "tests/slurm/test_pretrain_sbatch.py::test_a_failed_smoke_step_stops_the_job_before_the_run": None,
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything
def pytest_collection_modifyitems(config, items):
    """Mark the full-only cases; refuse a FULL_ONLY entry naming a missing file, or no test (or case) of a
    collected file."""
    seen: dict[str, set] = {}
    files = set()
    for item in items:
        files.add(item.nodeid.split("::")[0])
        func = item.nodeid.split("[")[0]
        if func not in FULL_ONLY:
            continue
        case = item.callspec.id if hasattr(item, "callspec") else None
        seen.setdefault(func, set()).add(case)
        keep = FULL_ONLY[func]
        if keep is None or case != keep:
            item.add_marker(pytest.mark.full)
    moved = sorted({k.split("::")[0] for k in FULL_ONLY if not (REPO / k.split("::")[0]).is_file()})
    if moved:  # a moved file's entries would otherwise stop marking anything, silently
        raise pytest.UsageError("tests/conftest.py FULL_ONLY names files that do not exist (moved?): "
                                f"{', '.join(moved)}")
    if any("::" in str(a) for a in config.args):  # a run of chosen tests: nothing to compare with
        return
    _check_end_to_end_cases(items)
    if _whole_suite(config):
        from harness.ids import missing

        gone = missing({item.nodeid for item in items})
        if gone:
            raise pytest.UsageError(f"{len(gone)} test ids of tests/harness/baseline_ids.txt are no longer collected "
                                    f"(map a renamed one in tests/harness/ids.py RENAMED): {', '.join(gone[:20])}")
    stale = [f"{k} (keep {v!r})" for k, v in FULL_ONLY.items() if k.split("::")[0] in files
             and (k not in seen or (v is not None and v not in seen[k]))]
    if stale:
        raise pytest.UsageError("tests/conftest.py FULL_ONLY names tests or cases that no longer exist "
                                f"(renamed?): {', '.join(stale)}")


def _whole_suite(config) -> bool:
    """The run collects everything under tests/ (no paths named, or tests/ itself)."""
    args = [Path(str(a)).resolve() for a in config.args]
    return not args or args == [REPO / "tests"] or args == [REPO]


def _check_end_to_end_cases(items) -> None:
    """Every test file that runs megatron-md commands or tools/ scripts (run_cli, shared_run, run_tool) keeps a case
    marked e2e in `make test-all`, which runs them through the real CLI and torchrun; its other cases may run in the
    pooled worlds. A test's own probe script (run_tool of a file under tests/) is not a path users take."""
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    missing = []
    for f, its in sorted(by_file.items()):
        if not any(call in (REPO / f).read_text() for call in ("run_cli(", "shared_run(", 'run_tool("tools/')):
            continue
        if not any(i.get_closest_marker("e2e") and not i.get_closest_marker("slow") for i in its):
            missing.append(f)
    if missing:
        raise pytest.UsageError("these test files run megatron-md commands but none of their cases in make test-all "
                                f"is marked e2e (through the real CLI and torchrun): {', '.join(missing)}")
