"""Zero-shot LR-transfer sweeps: a grid of widths x learning rates x optimizers x seeds, one
``megatron-md train`` per cell (resumable), results CSVs, the transfer plot and a coordinate check.

    megatron-md lr-sweep --model tiny-dense --out runs/lrt --widths 64,128 --lrs 3 --steps 20 \\
        --optimizers adamw,muon_md -- --mock-data
"""

from megatron_md.sweep.command import main

__all__ = ["main"]
