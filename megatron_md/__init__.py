"""megatron_md: MD decoupling and module-wise Manifold Muon on NVIDIA megatron-core.

Importing the package patches nothing; the CPU runtime is installed only when a run selects it.
"""

__version__ = "0.1.0"
