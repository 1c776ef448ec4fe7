"""Megatron's Mamba layers for the tests, with mamba-ssm's Triton kernels and no CUDA extension.

megatron-core's ``MambaMixer`` needs mamba-ssm's Triton SSD scan and gated RMSNorm (``mamba_ssm.ops.triton``);
causal-conv1d is optional there (without it the mixer runs ``torch.nn.Conv1d``), and with
``use_mamba_mem_eff_path=False`` nothing else is called. PyPI has no mamba-ssm wheels, and its package
``__init__`` imports the compiled ``selective_scan_cuda``; so the tests take mamba-ssm's source (the sdist that
``make setup`` unpacks into .cache/, or ``LOGITLESS_MAMBA_SSM_SRC``: a folder holding ``mamba_ssm/``) and register
``mamba_ssm`` as a package without running its ``__init__``. Test-side only.

On CPU the two Triton kernels are replaced by pure torch: the SSD scan by its recurrence (``ssd_recurrence``,
checked against mamba-ssm's chunked reference), the gated RMSNorm by mamba-ssm's ``rms_norm_ref``; the layer is
megatron-core's. On a GPU the kernels run as they are.
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.machinery
import importlib.util
import os
import sys

import pytest
import torch

import mcore_env
from required import required

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SRC_ENV = "LOGITLESS_MAMBA_SSM_SRC"


def mamba_source() -> str | None:
    """The folder that holds mamba-ssm's ``mamba_ssm/`` package source, or None."""
    candidates = [os.environ.get(SRC_ENV, "")] + sorted(glob.glob(os.path.join(ROOT, ".cache", "mamba_ssm-*")))
    for folder in candidates:
        if folder and os.path.isfile(os.path.join(folder, "mamba_ssm", "ops", "triton", "ssd_combined.py")):
            return folder
    return None


def mamba_mixer_module():
    """megatron-core's ``ssm.mamba_mixer`` with mamba-ssm's Triton ops importable (reloaded if it was imported
    before they were); skips (fails under LOGITLESS_REQUIRE_INTEGRATIONS=1) without mamba-ssm's source."""
    folder = mamba_source()
    if folder is None:
        msg = f"mamba-ssm's source is not unpacked (make setup puts it in .cache/; or set {SRC_ENV})"
        if required():
            raise ImportError(msg)
        pytest.skip(msg)
    for name in ("einops", "packaging"):      # what mamba-ssm's Triton ops import besides torch and triton
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if required():
                raise
            pytest.skip(f"mamba-ssm's Triton ops need {name}: {exc}")
    if "mamba_ssm" not in sys.modules:
        path = os.path.join(folder, "mamba_ssm")
        spec = importlib.machinery.ModuleSpec("mamba_ssm", None, is_package=True)
        spec.submodule_search_locations = [path]
        package = importlib.util.module_from_spec(spec)
        package.__path__ = [path]
        sys.modules["mamba_ssm"] = package
    import megatron.core.ssm.mamba_mixer as mixer
    if not mixer.HAVE_MAMBA_SSM or mixer.mamba_chunk_scan_combined is None:
        mixer = importlib.reload(mixer)
    assert mixer.HAVE_MAMBA_SSM, "megatron-core did not find mamba-ssm's Triton ops"
    return mixer


def ssd_recurrence(x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None, dt_softplus=False):
    """Mamba-2's SSD scan as its token-by-token recurrence, in float32 (the definition that mamba-ssm's chunked
    kernels compute): per head h, dt = softplus(dt + dt_bias), S_t = exp(dt_t A_h) S_(t-1) + dt_t x_t B_t^T,
    y_t = S_t C_t + D_h x_t, gated by silu(z) when z is given. x [b, l, h, p], dt [b, l, h], A [h],
    B and C [b, l, g, n], D [h] or [h, p], z [b, l, h, p]; returns [b, l, h, p] in x's dtype. (mamba-ssm's own
    pure-torch reference exponentiates the masked-out segment sums too, whose overflow turns its backward to NaN.)"""
    b, length, h, p = x.shape
    heads_per_group = h // B.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    Bh, Ch = (t.float().repeat_interleave(heads_per_group, dim=2) for t in (B, C))
    state = x.new_zeros(b, h, p, B.shape[-1], dtype=torch.float32)
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A.float())[..., None, None]
        state = state * decay + (dt[:, t, :, None] * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    return y.to(x.dtype)


@contextlib.contextmanager
def mamba_mixer():
    """``mamba_mixer_module()`` for a test module; afterwards ``mamba_ssm`` leaves ``sys.modules`` again (the
    mixer keeps the functions it imported), so that nothing after it takes the bare package for an install."""
    try:
        yield mamba_mixer_module()
    finally:
        for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
            del sys.modules[name]


@contextlib.contextmanager
def reference_kernels(mixer):
    """While open (CPU): the mixer's SSD scan runs ``ssd_recurrence`` and its gated RMSNorm mamba-ssm's
    pure-torch ``rms_norm_ref``."""
    from mamba_ssm.ops.triton.layernorm_gated import rms_norm_ref

    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, initial_states=None,
             return_final_states=False, **unused):
        assert initial_states is None and not return_final_states and not unused, unused
        return ssd_recurrence(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)

    def norm(self, x, z=None):
        return rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                            norm_before_gate=self.norm_before_gate)

    saved = mixer.mamba_chunk_scan_combined, mixer.ExtendedRMSNorm.forward
    mixer.mamba_chunk_scan_combined, mixer.ExtendedRMSNorm.forward = scan, norm
    try:
        yield
    finally:
        mixer.mamba_chunk_scan_combined, mixer.ExtendedRMSNorm.forward = saved


def build_mamba_hybrid(mixer, *, pattern: str = "M*-M", vocab: int = 262, hidden: int = 48, tied: bool = False,
                       seed: int = 0, chunk_size: int = 8, head_dim: int = 24, **cfg_kw):
    """A small fp32 HybridModel with Mamba ("M"), attention ("*") and MLP ("-") layers, local modules (no
    Transformer Engine): Megatron's MambaMixer (4 heads of ``head_dim``, state 16, one group) with
    ColumnParallelLinear / RowParallelLinear projections and SSD chunks of ``chunk_size`` tokens (small, so that
    short test sequences span several chunks)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec
    torch.manual_seed(seed)
    spec = mcore_env.hybrid_local_stack_spec()
    norm = spec.submodules.attention_layer.submodules.input_layernorm
    spec.submodules.mamba_layer = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=norm, mixer=ModuleSpec(module=mixer.MambaMixer, params={"chunk_size": chunk_size},
                                    submodules=mixer.MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)), mamba_bda=get_bias_dropout_add))
    cfg = TransformerConfig(num_layers=len(pattern), hidden_size=hidden, num_attention_heads=4,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            use_mamba_mem_eff_path=False, mamba_num_heads=4, mamba_head_dim=head_dim,
                            mamba_state_dim=16, mamba_num_groups=1, **cfg_kw)
    with mcore_env._final_norm_without_te(False):
        model = HybridModel(config=cfg, hybrid_stack_spec=spec, vocab_size=vocab, max_sequence_length=128,
                            hybrid_layer_pattern=pattern, position_embedding_type="learned_absolute",
                            share_embeddings_and_output_weights=tied)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "output_layer" in name or "word_embeddings" in name:
                p.mul_(25.0)
    return model
