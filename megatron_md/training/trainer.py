"""The training loop over megatron-core's pieces: GPTModel, DDP, schedules, optimizer, ckpt.

One step: micro-batches through ``get_forward_backward_func`` (PP-aware), DDP grad reduction,
a finiteness check of loss and gradients on every rank (a non-finite step is skipped before
it can touch the weights), ``optimizer.step()`` (global-norm clipping inside), LR schedule.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_current_global_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_md.mcore.families import family_of
from megatron_md.models.presets import count_parameters, human
from megatron_md.training.checkpoints import checkpointing as ckpt
from megatron_md.training.build import (
    build_optimizer_and_hooks,
    build_wrapped_model,
    global_batch_size,
    layer_wise,
    make_tokenizer,
    setup_parallel,
    vocab_size_for,
    with_vocab,
)
from megatron_md.training.checkpoints.preemption import TIME_UP, PreemptionWatch, mark_preempted, signal_name
from megatron_md.training.data.loader import batch_sizes, eval_start, stage_batches
from megatron_md.training.housekeeping import Housekeeping
from megatron_md.training.observability import throughput as tp
from megatron_md.training.config import RunConfig
from megatron_md.training.observability.profiling import StepProfiler
from megatron_md.training.observability.run_logging import RunLogger
from megatron_md.mcore.timing import interval_report, make_timers, timed
from megatron_md.training.step import all_finite, make_forward_step, reduce_loss
from megatron_md.training.validate import ConfigError


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. too many consecutive non-finite steps)."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_total: int = 0
    nan_total: int = 0
    consecutive_skips: int = 0
    history: list = field(default_factory=list)  # (iteration, loss) on the logging rank


# ----------------------------------------------------------------------------- setup helpers

def rampup_schedule(rampup: list[str] | None, global_batch: int) -> str | None:
    """Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES`` as the step schedule megatron-core 0.19
    runs instead (it ignores ``rampup_batch_size``): START + k x INCREMENT from k x SAMPLES / n samples on,
    n = (global - START) / INCREMENT steps, reaching the global batch once SAMPLES were consumed."""
    if not rampup:
        return None
    start, incr, samples = (int(x) for x in rampup)
    steps = (global_batch - start) // incr
    return " ".join(f"{math.ceil(k * samples / steps)}:{start + k * incr}" for k in range(steps + 1))


def is_logging_rank() -> bool:
    return (
        ps.is_pipeline_last_stage()
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )


# ----------------------------------------------------------------------------- the run

class Trainer:
    def __init__(self, cfg: RunConfig):
        self.start_time = time.time()  # --exit-duration-in-mins counts from here
        self.cfg = cfg
        self.rt = setup_parallel(cfg)
        self.cpu = self.rt.name == "cpu"
        self.housekeeping = Housekeeping(cfg.training, cuda=self.rt.name == "cuda")
        self.tokenizer = make_tokenizer(cfg)
        self.vocab = vocab_size_for(cfg, self.tokenizer)
        self.model, self.tconfig = build_wrapped_model(cfg, self.vocab, self.cpu)
        # megatron-core's timers, read by the schedules (model config) and the optimizers (OptimizerConfig)
        self.timers = make_timers(cfg.logging.timing_log_level, cfg.logging.timing_log_option)
        self.tconfig.timers = self.timers
        self.optimizer, self.scheduler, self.hooks = build_optimizer_and_hooks(cfg, self.model, self.timers)
        family_of(cfg).after_build(self.optimizer)  # step 0's forward sees the projected weights
        self.gbs = global_batch_size(cfg)
        cfg.training.global_batch_size = self.gbs  # saved with checkpoints: score --validation needs it
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.num_micro = self.gbs // (self.dp_size * cfg.training.micro_batch_size)
        # megatron-core's calculator: the batch size of each step (constant, or ramped up by consumed samples)
        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(
            dist.get_rank(), None, self.gbs, cfg.training.micro_batch_size, self.dp_size,
            decrease_batch_size_if_needed=False,
            step_batch_size_schedule=rampup_schedule(cfg.training.rampup_batch_size, self.gbs))
        self.state = TrainState()
        self.forward_backward = get_forward_backward_func()
        self.logger_lines: list[str] = []
        self.resumed = self._maybe_load()
        self.logger = RunLogger(
            self._run_dir(),
            cfg,
            active=is_logging_rank(),
            resumed=self.resumed,
            runtime_desc=self.rt.describe(),
            world_size=dist.get_world_size(),
        )
        self._announce()
        self.train_ds, self.valid_ds = self._datasets()
        self.train_batches = self.valid_batches = None  # this rank's batch streams, opened by train()
        from megatron_md.training.observability.diagnostics import AttentionProbe

        self.probe = AttentionProbe(ckpt.unwrap(self.model)) if cfg.logging.diagnostics_interval else None
        self.before_update: dict | None = None  # --log-update-norms: the matrices before a diagnostics step
        self.qk = self._qk_clip()
        self.preemption = PreemptionWatch(cfg.training.exit_signal_handler)
        self.preempted_by: str | None = None
        self.timed_out = False
        self.opt_timer = tp.StepTimer(self.rt.device)
        self.expert_load = tp.ExpertLoad(self.model) if cfg.model.num_experts else None
        self.profiler = StepProfiler(cfg.training, Path(cfg.logging.run_dir), dist.get_rank(), self.rt.name == "cuda")
        dtype = torch.bfloat16 if cfg.training.bf16 else torch.float32
        self.peak_tflops, peak_source = tp.peak_tflops(self.rt.device, dtype)
        self.step_flops_per_sample = tp.model_flops_per_step(cfg.model, self.vocab, 1)
        self.logger.print(
            f"model FLOPs per step: {self.step_flops_per_sample * self.gbs:.3e}; peak for MFU: "
            + (f"{self.peak_tflops:.3g} TFLOP/s per device ({peak_source})" if self.peak_tflops else peak_source))

    # -- setup

    def _qk_clip(self):
        o = self.cfg.optimizer
        if not (o.qk_clip or self.cfg.logging.log_max_logit):
            return None
        from megatron_md.mcore.qk_clip import QKClip

        qk = QKClip(self.model, self.optimizer, clip=o.qk_clip, threshold=o.qk_clip_threshold,
                    alpha=o.qk_clip_alpha, num_layers=self.cfg.model.num_layers)
        self.logger.print(qk.describe())
        return qk

    def _run_dir(self) -> Path:
        lg = self.cfg.logging
        name = [lg.run_dir]
        if dist.get_rank() == 0 and name[0] is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            name[0] = f"runs/{stamp}-{self.cfg.preset or 'custom'}"
        dist.broadcast_object_list(name, src=0)
        lg.run_dir = name[0]
        return Path(name[0])

    def _maybe_load(self) -> bool:
        c = self.cfg.checkpoint
        from megatron_md.training.checkpoints import megatron_lm

        # Megatron-LM's own checkpoints (no run_config.yaml; its args in the common state) load through their reader
        if found := megatron_lm.find(c.load):
            common = megatron_lm.load(
                c.load, *found, self.model, self.optimizer, self.scheduler, load_optim=not c.no_load_optim,
                cfg=self.cfg, fully_parallel=c.ckpt_fully_parallel_load, log=self.logger_lines.append,
                hooks=self.hooks)
        elif c.load and ckpt.latest_iteration(c.load) is not None:
            common = ckpt.load_checkpoint(
                c.load, self.model, self.optimizer, self.scheduler,
                load_optim=not c.no_load_optim, load_rng=not c.no_load_rng, layer_wise=layer_wise(self.cfg),
                verify=not c.no_verify_checkpoint, fully_parallel=c.ckpt_fully_parallel_load, hooks=self.hooks,
            )
        if c.load and (found or ckpt.latest_iteration(c.load) is not None):
            self.state.iteration = common["iteration"]
            self.state.consumed_samples = common["consumed_samples"]
            extra = common.get("extra", {})
            self.state.skipped_total = extra.get("skipped_total", 0)
            self.state.nan_total = extra.get("nan_total", 0)
            self.logger_lines += self.hooks.load_state_dict(extra.get("auto_policy"), self.optimizer)
            self._loaded_from = common["path"]
            if note := common.get("weights_note"):  # --no-load-optim
                self.logger_lines.append(note)
            return True
        if c.pretrained_checkpoint and (found := megatron_lm.find(c.pretrained_checkpoint)):
            common = megatron_lm.load(
                c.pretrained_checkpoint, *found, self.model, self.optimizer, load_optim=False, cfg=self.cfg,
                fully_parallel=c.ckpt_fully_parallel_load, log=self.logger_lines.append, hooks=self.hooks)
            self._loaded_from = common["path"] + " (Megatron-LM, weights only)"
        elif c.pretrained_checkpoint:
            common = ckpt.load_checkpoint(
                c.pretrained_checkpoint, self.model, self.optimizer, load_optim=False, load_rng=False,
                verify=not c.no_verify_checkpoint, fully_parallel=c.ckpt_fully_parallel_load, hooks=self.hooks,
            )
            self._loaded_from = common["path"] + " (weights only)"
        if c.pretrained_checkpoint and (note := common.get("weights_note")):
            self.logger_lines.append(note)  # what the MD / manifold state kept or moved of the loaded weights
        return False

    def _announce(self) -> None:
        cfg, log = self.cfg, self.logger
        counts = count_parameters(with_vocab(cfg.model, self.vocab))
        local = sum(p.numel() for p in self.model.parameters())
        built = ckpt.unwrap(self.model)
        log.print(f"megatron_md | {self.rt.describe()}")
        log.print(
            f"model {cfg.preset or 'custom'}: {human(counts.total)} parameters "
            f"({human(counts.active)} active, {human(counts.embedding)} embedding); "
            f"this rank holds {human(local)}; layer spec: "
            f"{'transformer_engine' if getattr(built, 'megatron_md_uses_te', False) else 'local'}, attention "
            f"{getattr(built, 'megatron_md_attention', '?')}"
        )
        p = cfg.parallel
        log.print(
            f"parallel: world {dist.get_world_size()} = TP {p.tensor_model_parallel_size} x PP "
            f"{p.pipeline_model_parallel_size} x DP {self.dp_size} (EP {p.expert_model_parallel_size}); "
            f"global batch {self.gbs} = {self.num_micro} micro-batches x {cfg.training.micro_batch_size} x DP"
        )
        if hasattr(self, "_loaded_from"):
            log.print(f"loaded checkpoint {self._loaded_from} at iteration {self.state.iteration}")
        for line in self.hooks.describe():
            log.print(line)
        for line in self.logger_lines:
            log.print(line)
        if housekeeping := self.housekeeping.describe():
            log.print(housekeeping)
        log.print(f"run directory: {Path(cfg.logging.run_dir).resolve()}")

    def _datasets(self):
        cfg, t = self.cfg, self.cfg.training
        from megatron_md.training.data.datasets import build_gpt_datasets, dataset_options

        evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 1
        sizes = (t.train_iters * self.gbs, evals * t.eval_iters * self.gbs, 0)
        # Every rank calls the builder; megatron-core builds the index caches on rank 0 first.
        built = [build_gpt_datasets(
            cfg.data.data_path, cfg.data.split, cfg.model.seq_length, t.seed, self.tokenizer,
            *sizes, mock=cfg.data.mock_data, path_to_cache=cfg.data.data_cache_path,
            vocab_size=self.vocab, **dataset_options(cfg.data),
        )]
        train, valid, _ = built[0]
        return train, valid

    # -- steps

    def _stage_batches(self, dataset, consumed: int, *, evaluation: bool = False, limit: int | None = None):
        """This rank's micro-batches from ``consumed`` on (``limit`` global batches, or endless): training's at the
        run's batch sizes, evaluation's at the run's global batch size."""
        d, t = self.cfg.data, self.cfg.training
        sizes = ((lambda _consumed: self.gbs) if evaluation else
                 batch_sizes(rampup_schedule(t.rampup_batch_size, self.gbs), self.gbs, t.micro_batch_size, self.dp_size))
        return stage_batches(dataset, consumed=consumed, sizes=sizes, micro=t.micro_batch_size, dp_rank=self.dp_rank,
                             dp_size=self.dp_size, num_workers=d.num_workers, device=self.rt.device,
                             seq_length=self.cfg.model.seq_length, attention_mask=d.reset_attention_mask, limit=limit)

    def train_step(self) -> tuple[float | None, float | None, bool]:
        """One optimizer step over the current global batch (``self.step_gbs`` sequences)."""
        t = self.cfg.training
        update_num_microbatches(self.state.consumed_samples, consistency_check=True)
        self.step_gbs = get_current_global_batch_size()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        it = self.state.iteration + 1
        if self.probe is not None:
            self.probe.armed = self._diagnostics_due(it)
            if self.probe.armed and self.cfg.logging.log_update_norms:
                from megatron_md.training.observability.diagnostics import snapshot

                with self.params_synced():
                    self.before_update = snapshot(self.model)
        if self.qk is not None:
            self.qk.arm(it % self.cfg.logging.log_interval == 0 or it == t.train_iters)
        nan_now = t.inject_nan_at is not None and t.inject_nan_at <= it < t.inject_nan_at + t.inject_nan_iters
        losses = self.forward_backward(  # (megatron-core's schedules time it: forward-backward)
            forward_step_func=make_forward_step(nan_now, self.timers), data_iterator=self.train_batches,
            model=[self.model], num_microbatches=get_num_microbatches(), seq_length=self.cfg.model.seq_length,
            micro_batch_size=t.micro_batch_size, forward_only=False)
        self.housekeeping.after_forward_backward()
        loss = reduce_loss(losses)
        if self.probe is not None:
            self.probe.armed = False
        if not all_finite(self.model, loss):
            if self.qk is not None:
                self.qk.discard()
            self.optimizer.zero_grad()
            self.model.zero_grad_buffer()
            return loss, None, False
        if self.qk is not None:
            with timed(self.timers, "qk-clip"):
                self.qk.before_step()  # this step's maxima over ranks; the factors the step applies
        with self.opt_timer, timed(self.timers, "optimizer"):
            ok, grad_norm, _ = self.optimizer.step()
        if self.qk is not None:
            with timed(self.timers, "qk-clip"):
                self.qk.after_step()
        if ok:
            self.scheduler.step(increment=self.step_gbs)
        return loss, grad_norm, bool(ok)

    @contextlib.contextmanager
    def params_synced(self):
        """With --overlap-param-gather the updated weights arrive bucket by bucket in the next forward's
        pre-hooks; evaluation, saving and diagnostics need them all now (Megatron-LM does the same)."""
        if not self.cfg.parallel.overlap_param_gather:
            yield
            return
        self.model.disable_forward_pre_hook()  # a synchronous all-gather of every bucket
        try:
            yield
        finally:
            self.model.enable_forward_pre_hook()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.valid_ds is None or len(self.valid_ds) == 0 or self.cfg.training.eval_iters == 0:
            return None  # --eval-iters 0 means no evaluation, as in Megatron-LM (0 batches gave NaN)
        self.housekeeping.around_evaluation()
        try:
            with self.params_synced():
                return self._evaluate()
        finally:
            self.housekeeping.around_evaluation()

    def _evaluate(self) -> float | None:
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        t = self.cfg.training
        if self.cfg.data.eval_same_batches:
            batches = self._stage_batches(self.valid_ds, 0, evaluation=True, limit=t.eval_iters)
        else:  # one iterator for the run: each evaluation takes the next eval_iters global batches
            if self.valid_batches is None:
                start = eval_start(self.state.iteration, t.eval_interval, t.eval_iters, self.gbs, False)
                self.valid_batches = self._stage_batches(self.valid_ds, start, evaluation=True)
            batches = self.valid_batches
        for _ in range(t.eval_iters):
            losses = self.forward_backward(
                forward_step_func=make_forward_step(False),
                data_iterator=batches,
                model=[self.model],
                num_microbatches=self.num_micro,
                seq_length=self.cfg.model.seq_length,
                micro_batch_size=self.cfg.training.micro_batch_size,
                forward_only=True,
            )
            if ps.is_pipeline_last_stage():
                for d in losses:
                    total += d["lm loss"].double().cpu()
        self.model.train()
        if not ps.is_pipeline_last_stage():
            return None
        dev_total = total.to(self.rt.device) if self.rt.name == "cuda" else total
        dist.all_reduce(dev_total, group=ps.get_data_parallel_group())
        return (dev_total[0] / dev_total[1]).item()

    def save(self) -> Path:
        c = self.cfg.checkpoint
        self._publish_finished_saves(blocking=True)  # one background save at a time, published in order
        with self.params_synced():
            path = self._save(c)
        if c.async_save:
            self.logger.print(f"saving checkpoint {path.resolve()} in the background")
        else:
            self.logger.print(f"saved checkpoint {path.resolve()}")
        return path

    def _publish_finished_saves(self, blocking: bool) -> None:
        if self.cfg.checkpoint.async_save and ckpt.finalize_saves(blocking=blocking):
            self.logger.print("background checkpoint save finished and published")

    def _save(self, c) -> Path:
        return ckpt.save_checkpoint(
            c.save, self.state.iteration, self.model, self.optimizer, self.scheduler,
            consumed_samples=self.state.consumed_samples,
            run_config_yaml=self.cfg.to_yaml(),
            tokenizer_model=self.cfg.data.tokenizer_model,
            extra={"skipped_total": self.state.skipped_total, "nan_total": self.state.nan_total,
                   "auto_policy": self.hooks.state_dict()},
            layer_wise=layer_wise(self.cfg),
            fully_reshardable=c.dist_ckpt_optim_fully_reshardable,
            async_save=c.async_save,
            fully_parallel=c.ckpt_fully_parallel_save,
            keep_last=c.keep_last_n_checkpoints,
            hooks=self.hooks,
        )

    def _count_step(self, interval: dict, loss, grad_norm, ok: bool) -> None:
        """One step into the state and the log interval; a non-finite one is counted as skipped, and too many in
        a row stop the run."""
        s, t = self.state, self.cfg.training
        s.iteration += 1
        s.consumed_samples += self.step_gbs
        interval["iters"] += 1
        interval["samples"] += self.step_gbs
        if ok:
            s.consecutive_skips = 0
            if loss is not None:
                interval["loss"] += loss
                interval["n"] += 1
            interval["grad_norm"] = grad_norm
            s.history.append((s.iteration, loss))
            return
        s.skipped_total += 1
        s.consecutive_skips += 1
        interval["skipped"] += 1
        if loss is None or not math.isfinite(loss):
            s.nan_total += 1
            interval["nan"] += 1
        self.logger.print(f"[warn] iteration {s.iteration}: non-finite loss or gradient, update skipped")
        if s.consecutive_skips >= t.max_consecutive_skips:
            raise TrainingStopped(
                f"stopping: {s.consecutive_skips} consecutive iterations had a non-finite loss "
                f"or gradient (--max-consecutive-skips {t.max_consecutive_skips}); lower --lr, "
                "check the data, or resume from the last checkpoint"
            )

    def _told_to_stop(self) -> bool:
        """A preemption signal or the --exit-duration-in-mins deadline (every rank agrees): noted and logged."""
        s, log, deadline = self.state, self.logger, self.cfg.training.exit_duration_in_mins
        signum = self.preemption.poll(None if deadline is None else time.time() - self.start_time > 60.0 * deadline)
        if signum == TIME_UP:
            self.timed_out = True
            log.print(f"--exit-duration-in-mins {deadline:g} reached at iteration {s.iteration}: "
                      + ("saving and exiting" if self.cfg.checkpoint.save else "exiting (no --save)"))
            return True
        if signum:
            self.preempted_by = signal_name(signum)
            log.print(f"received {self.preempted_by} at iteration {s.iteration}: saving and exiting")
            return True
        return False

    def train(self) -> TrainState:
        cfg, t, s, log = self.cfg, self.cfg.training, self.state, self.logger
        interval = self._new_interval()
        self.model.train()
        self.train_batches = self._stage_batches(self.train_ds, s.consumed_samples)  # (validation's: at its first use)
        try:
            while s.iteration < t.train_iters:
                self.profiler.before_step(s.iteration + 1)
                t0 = time.perf_counter()  # only the step is timed: not evaluation, saving or diagnostics
                loss, grad_norm, ok = self.train_step()
                interval["train_s"] += time.perf_counter() - t0
                self._count_step(interval, loss, grad_norm, ok)
                self.housekeeping.after_step(s.iteration)
                trace = self.profiler.after_step(s.iteration)
                if trace:
                    print(f"[rank {dist.get_rank()}] profiler trace written to {trace}", flush=True)
                log.progress(s.iteration)
                if s.iteration % cfg.logging.log_interval == 0 or s.iteration == t.train_iters:
                    self._log_interval(interval)
                    interval = self._new_interval()
                if t.eval_interval and s.iteration % t.eval_interval == 0 and s.iteration < t.train_iters:
                    self._eval_and_log()
                if cfg.checkpoint.save and cfg.checkpoint.save_interval and s.iteration % cfg.checkpoint.save_interval == 0:
                    self.save()
                self._publish_finished_saves(blocking=False)
                if self._told_to_stop() or (t.exit_interval and s.iteration % t.exit_interval == 0):
                    break
            # train_iters 0 makes a seed checkpoint: the initial weights, saved, no evaluation. A preempted
            # run skips the final evaluation: the grace time before the kill is for the checkpoint.
            self.profiler.finish()
            run_eval = t.train_iters > 0 and not self.preempted_by and not self.timed_out
            self.final_eval_loss = self._eval_and_log() if run_eval else None
            if cfg.checkpoint.save and not (
                cfg.checkpoint.save_interval and s.iteration % cfg.checkpoint.save_interval == 0
            ):
                self.save()
            self._publish_finished_saves(blocking=True)
            if self.preempted_by:
                save = cfg.checkpoint.save
                msg = f"preempted by {self.preempted_by}: " + (
                    f"checkpoint of iteration {s.iteration} in {save}; relaunch with --load {save} to resume"
                    if save else "nothing saved (no --save)") + "; exiting 0"
                log.print(msg)
                mark_preempted(msg)
        finally:
            self.train_batches = self.valid_batches = None  # stops the loaders' workers
            self.preemption.restore()
            self.housekeeping.close()
            log.close()
        return s

    def _eval_and_log(self):
        loss = self.evaluate()
        if loss is not None:
            self.logger.log_eval({"iteration": self.state.iteration, "eval_lm_loss": loss})
        return loss

    def _new_interval(self) -> dict:
        return {"loss": 0.0, "n": 0, "skipped": 0, "nan": 0, "train_s": 0.0, "iters": 0, "samples": 0,
                "grad_norm": None}

    def _log_interval(self, iv: dict) -> None:
        """One log record (a collective: every rank calls it at the same iterations)."""
        per_iter = iv["train_s"] / max(iv["iters"], 1)
        world = dist.get_world_size()
        tokens = iv["samples"] * self.cfg.model.seq_length
        flops_per_s = self.step_flops_per_sample * iv["samples"] / max(iv["train_s"], 1e-9)
        tflops = flops_per_s / world / 1e12
        # The slowest rank's optimizer step and the largest rank's peak memory, in one reduction.
        opt_ms = self.opt_timer.take_ms()
        worst = torch.tensor([opt_ms or 0.0, float(tp.peak_memory_bytes(self.rt.device))], dtype=torch.float64,
                             device=self.rt.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rec = {
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_samples,
            "lm_loss": iv["loss"] / iv["n"] if iv["n"] else None,
            **self.hooks.log_lrs(self.optimizer),  # "lr", and the family's matrix LR when it has one
            "grad_norm": float(iv["grad_norm"]) if iv["grad_norm"] is not None else None,
            "tokens_per_s": tokens / max(iv["train_s"], 1e-9),
            "iter_time_ms": per_iter * 1000.0,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "optimizer_ms": float(worst[0]) if opt_ms is not None else None,
            "peak_memory_gib": float(worst[1]) / 2**30,
            "global_batch_size": self.step_gbs,
            "skipped": iv["skipped"],
            "nan": iv["nan"],
            "skipped_total": self.state.skipped_total,
        }
        if self.cfg.model.num_experts:
            rec.update(tp.take_moe_losses(self.cfg.model, iv["iters"], get_num_microbatches(), self.state.iteration))
            load = self.expert_load.take(self.rt.device)
            if load is not None:
                rec["moe_expert_load_max"], rec["moe_expert_load_min"] = load
        if self._diagnostics_due(self.state.iteration):
            from megatron_md.training.observability.diagnostics import collect

            with self.params_synced():
                diag = collect(self.model, self.hooks.matrix_gains(self.optimizer), self.probe, self.before_update)
            self.before_update = None
            rec.update(diag)
            for line in self.hooks.observe(self.optimizer, diag):
                self.logger.print(line)
        if self.qk is not None:
            rec.update(self.qk.log_fields(self.rt.device))
        timers_text, timers_ms = interval_report(self.timers, self.cfg.logging.timing_log_level, iv["iters"])
        rec.update(timers_ms)
        self.logger.log_train(rec)
        if timers_text:
            self.logger.print(timers_text)

    def _diagnostics_due(self, iteration: int) -> bool:
        lg = self.cfg.logging
        if not lg.diagnostics_interval:
            return False
        every = -(-lg.diagnostics_interval // lg.log_interval) * lg.log_interval
        return iteration % every == 0 or iteration == self.cfg.training.train_iters


def run(cfg: RunConfig) -> TrainState:
    """Entry point used by the CLI in every rank."""
    trainer = Trainer(cfg)
    return trainer.train()


__all__ = ["Trainer", "run", "TrainingStopped", "ConfigError"]
