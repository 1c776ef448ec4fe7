"""The output layer as logitless' fused paths (the processor, the fused MTP losses) read it: its tensor-parallel
group and the MuP logit scale (``scale_logits``) as one constant."""
from __future__ import annotations

import math

import torch
from torch import Tensor

_SCALE_PROBE = (1.0, -2.5, 0.75, 3.0)


def tp_group_and_size(output_layer, config):
    """The output layer's tensor-parallel group and its size. Releases whose layers do not carry
    ``tp_group`` use the global model-parallel state when the config says TP > 1."""
    group = getattr(output_layer, "tp_group", None)
    if group is None and int(getattr(config, "tensor_model_parallel_size", 1) or 1) > 1:
        from megatron.core import parallel_state
        group = parallel_state.get_tensor_model_parallel_group()
    if group is None:
        return None, 1
    return group, group.size()


def logit_scale(scale_logits) -> float:
    """The constant c with scale_logits(z) == c * z (Megatron's MuP output multiplier), probed on a
    few values. Raises ValueError for anything else (e.g. a soft cap), which the fused path cannot
    reproduce; None means no scaling."""
    if scale_logits is None:
        return 1.0
    probe = torch.tensor(_SCALE_PROBE, dtype=torch.float32)
    out = scale_logits(probe.clone())
    if not isinstance(out, Tensor) or out.shape != probe.shape:
        raise ValueError("scale_logits must map a logits tensor to one of the same shape; logitless "
                         "cannot fuse it")
    c = float(out[0])
    if not (math.isfinite(c) and c > 0 and torch.allclose(out.float(), probe * c, rtol=1e-6, atol=0.0)):
        raise ValueError("scale_logits is not multiplication by a positive constant (e.g. a logit soft "
                         "cap); the fused path cannot reproduce it. Disable it or use the unfused path")
    return c
