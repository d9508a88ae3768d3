"""Initial values of the logical (unsharded) tensors, independent of any layout.

Each tensor is drawn whole from a generator seeded by (seed, tensor name), then every rank
keeps the pieces the mapping gives it. So all layouts, and the single-process reference, start
from identical values. GPT-2 style: N(0, 0.02), residual output projections scaled by
1/sqrt(2 * layers), norms at one, biases at zero.
"""

from __future__ import annotations

import math
import zlib

import torch

from dynatrain.vps.model import ModelSpec, TensorSpec

_RESIDUAL_OUTPUTS = (".attn.o.weight", ".mlp.fc2.weight", ".mlp.down.weight", ".experts.down")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def initial_tensor(model: ModelSpec, tensor: TensorSpec, seed: int) -> torch.Tensor:
    name = tensor.name
    if name.endswith("norm.weight"):
        full = torch.ones(tensor.shape)
    elif name.endswith(".bias"):
        full = torch.zeros(tensor.shape)
    else:
        std = 0.02
        if name.endswith(_RESIDUAL_OUTPUTS):
            std /= math.sqrt(2 * model.num_layers)
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        full = torch.empty(tensor.shape).normal_(0.0, std, generator=g)
    return full.to(TORCH_DTYPES[tensor.dtype])
