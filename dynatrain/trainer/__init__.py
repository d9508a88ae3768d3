"""The reference trainer: GPT and MoE training with DP, TP, PP, EP and ZeRO.

Every local tensor is allocated from :mod:`dynatrain.vps.mapping`, so the layout the planner
reasons about is exactly the layout that runs. Modules, one job each: ``config`` (what to
train), ``data`` (deterministic token streams), ``groups`` (process groups of a layout),
``tp`` (Megatron's tensor-parallel operators), ``model`` (one pipeline stage's forward),
``moe`` (routing and expert-parallel dispatch), ``optim`` (gradient reduction and ZeRO AdamW),
``trainer`` (allocation, the pipeline schedule, training state in and out), ``launch``
(processes on this machine, torchrun, the ``dynatrain train`` command) and ``evaluate`` (the
mean loss over a data file's first N samples under any layout, ``dynatrain eval``).
"""

from .config import TrainConfig

__all__ = ["TrainConfig"]
