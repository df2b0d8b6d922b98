"""Multi-rank probe: at TP2 x PP2 (4 ranks) or TP2 (2 ranks), who reads and what every rank receives.

Run by tests/training/data/test_loader.py. Each rank builds the micro-batches the trainer would (megatron_md's
``setup_parallel`` and ``stage_batches``, DataLoader workers on) and reports whether it holds a loader and the
first token of every sample it got; rank 0 prints ``PROBE [per-rank dicts]``.
"""

from __future__ import annotations

import json
import sys

import torch


class Seq:
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        t = torch.full((8,), i)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(8), "position_ids": torch.arange(8)}


def main() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_md.training.arguments import quiet_megatron
    from megatron_md.training.build import setup_parallel
    from megatron_md.training.config import resolve
    from megatron_md.training.data.loader import stage_batches

    quiet_megatron()
    cli = {"mock_data": True, "device": "cpu", **json.loads(sys.argv[1])}
    setup_parallel(resolve("tiny-dense", None, cli))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = stage_batches(Seq(), consumed=8, sizes=lambda _c: 4, micro=2, dp_rank=dp_rank, dp_size=dp,
                            num_workers=2, device=torch.device("cpu"), seq_length=8, attention_mask=False, limit=2)
    got = []
    for _ in range(4 // dp // 2 * 2):  # two global batches
        b = next(batches)
        got.append(None if b is None else {k: (None if v is None else v[:, 0].tolist()) for k, v in b.items()})
    mine = {"rank": dist.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "reads": batches.source is not None, "got": got}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print("PROBE " + json.dumps(every), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
