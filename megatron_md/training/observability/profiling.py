"""``--profile``: a torch profiler trace of steps [--profile-step-start, --profile-step-end) on the
--profile-ranks, written as a Chrome/Perfetto trace into ``<run-dir>/profile/``."""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, training_cfg, run_dir: Path, rank: int, cuda: bool):
        t = training_cfg
        ranks = {int(r) for r in (t.profile_ranks or ["0"])}
        self.enabled = bool(t.profile) and rank in ranks
        self.start, self.end = t.profile_step_start, t.profile_step_end
        self.out = Path(run_dir) / "profile" / f"trace_rank{rank}_steps{self.start}-{self.end - 1}.json"
        self.cuda = cuda
        self.prof = None

    def before_step(self, iteration: int) -> None:
        """``iteration`` is the step about to run (1-based)."""
        if self.enabled and iteration == self.start and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.start()

    def after_step(self, iteration: int) -> Path | None:
        """Stops and writes the trace after step ``end - 1`` (or at the last step); returns its path."""
        if self.prof is None or iteration < self.end - 1:
            return None
        return self.finish()

    def finish(self) -> Path | None:
        if self.prof is None:
            return None
        self.prof.stop()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.out))
        self.prof = None
        self.enabled = False
        return self.out
