"""The generic instance forwards that `apply.py` binds onto a model's modules.

One set of forwards serves every Llama-layout family; a FamilySpec (patch/specs/) says which attributes to use.
Each patched module keeps its stock forward as `_novatune_stock_forward` and falls back to it whenever the fast
path does not apply (KV-cache decoding, attention dropout...), so a
patched model computes what the stock model computes in every mode.

Packed rows: the decoder stack's forward pre-hook builds one `PackedBatch` per batch (cu_seqlens on the host, no
device sync per layer) and passes it down through HF's **kwargs as `novatune_packed`; gradient checkpointing
captures the kwargs, so the recompute in backward sees the same metadata.
"""
from __future__ import annotations

import torch

from novatune.attention.backends import varlen_attention
from novatune.attention.packed import PackedBatch
from novatune.ops.geglu import geglu_mlp
from novatune.ops.linear import project
from novatune.ops.offset_rms_norm import offset_rms_norm
from novatune.ops.qk_norm_rope import qk_norm_rope
from novatune.ops.rms_norm import rms_norm
from novatune.ops.rope import apply_rope
from novatune.ops.swiglu import swiglu_gate_up_mlp, swiglu_mlp
from novatune.patch.host_offsets import HOST_OFFSETS_KWARG
from novatune.patch.lora import grouped_qlora
from novatune.patch.tiled import tiled_rows

PACKED_KWARG = "novatune_packed"


def rms_norm_forward(self, hidden_states):
    eps = getattr(self, self._novatune_eps_attr)
    if self._novatune_norm_rounding == "output":
        # round((offset + w) * x_hat) once, in x's dtype, all in fp32 (Gemma: offset 1; GPT-OSS: 0). The Llama
        # rounding (w * round(x_hat), result in promote(x, w)) would differ by a rounding and, with the fp32 norm
        # weights GPT-OSS loads, return fp32 activations
        return offset_rms_norm(hidden_states, self.weight, eps, self._novatune_norm_offset)
    return rms_norm(hidden_states, self.weight, eps)


_GLU_MLPS = {"swiglu": swiglu_mlp, "geglu": geglu_mlp}
# set on an MLP module while it runs under a checkpoint of its own (memory.policy recompute_mlp)
OWN_CHECKPOINT = "_novatune_mlp_own_checkpoint"


def call_under_own_checkpoint(mlp: torch.nn.Module, forward, *args, **kwargs):
    """forward(*args, **kwargs) of `mlp`, which runs under a checkpoint of its own; pass this (with mlp and
    forward bound) as the checkpointed function, so that the recompute in the backward runs it the same way.
    Nothing inside that checkpoint reads the down projection's output, so its recompute stops before the down
    projection's GEMM, which linear_wgrad_in_place "auto" then leaves to autograd (see _down_wgrad)."""
    nested = OWN_CHECKPOINT in mlp.__dict__
    mlp.__dict__[OWN_CHECKPOINT] = True
    try:
        return forward(*args, **kwargs)
    finally:
        if not nested:
            del mlp.__dict__[OWN_CHECKPOINT]


def _down_wgrad(self, own_checkpoint: bool) -> bool:
    """Whether the down projection adds its weight gradient into .grad inside its GEMM (novatune.ops.linear).

    linear_wgrad_in_place True / False (`_novatune_down_wgrad` None): as every other projection. "auto": only where
    a recompute runs the GEMM anyway. novatune.ops.linear is an autograd Function, whose saved tensors are packed
    after its GEMM, so a checkpoint's recompute cannot stop before it as it stops before aten's mm. A post-norm
    inside the layer's checkpoint reads the output (OLMo 2: `_novatune_down_wgrad` True), so there the GEMM runs
    again in any case; under a checkpoint of the MLP's own (recompute_mlp, the tiled MLP's row chunks) nothing
    reads it (OLMo-2-7B under recompute_mlp: 10,972 tok/s in place against 11,339 returned, bench.jsonl
    session30-2; in another call, 11,706 with the down projection alone returned against 11,650, session30-3)."""
    auto = self._novatune_down_wgrad
    if auto is None:
        return self._novatune_linear_wgrad
    return auto and not (own_checkpoint or OWN_CHECKPOINT in self.__dict__)


def _swiglu_mlp(self, x, own_checkpoint: bool = False):
    names = self._novatune_mlp
    down = _down_wgrad(self, own_checkpoint)
    if names.gate_up_proj is not None:
        # Phi-3: one projection whose output is [gate | up] (HF chunks it in two); a SiLU gate (the spec's glu)
        return swiglu_gate_up_mlp(x, getattr(self, names.gate_up_proj), getattr(self, names.down_proj),
                                  inplace_backward=self._novatune_swiglu_inplace,
                                  wgrad_in_place=self._novatune_linear_wgrad, down_wgrad_in_place=down)
    return _GLU_MLPS[names.glu](x, getattr(self, names.gate_proj), getattr(self, names.up_proj),
                                getattr(self, names.down_proj), inplace_backward=self._novatune_swiglu_inplace,
                                wgrad_in_place=self._novatune_linear_wgrad, down_wgrad_in_place=down)


def swiglu_mlp_forward(self, x):
    tiling = self._novatune_tiling
    if tiling is not None and tiling.applies(x):
        # each row chunk runs under a checkpoint of its own
        return tiled_rows(lambda rows: _swiglu_mlp(self, rows, own_checkpoint=True), x, tiling.chunk_rows(x))
    return _swiglu_mlp(self, x)


def tiled_stock_mlp_forward(self, x):
    """An MLP kept stock (swiglu off, or an activation the kernel does not compute), tiled on long rows."""
    tiling = self._novatune_tiling
    if tiling.applies(x):
        return tiled_rows(self._novatune_stock_forward, x, tiling.chunk_rows(x))
    return self._novatune_stock_forward(x)


def has_cache(kwargs: dict) -> bool:
    """A KV cache in a model call's kwargs, under transformers' current name (`cache`) or the older one."""
    return kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None


def attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """Llama-layout attention in (batch, seq, heads, head_dim) layout end to end: no transposes, no K/V repeat.
    The KV cache stays in **kwargs under the caller's name, passed on untouched to the stock forward."""
    packed: PackedBatch | None = kwargs.get(PACKED_KWARG)
    dropout = self.attention_dropout if self.training else 0.0
    if packed is None or has_cache(kwargs) or position_embeddings is None or dropout > 0.0:
        kwargs.pop(PACKED_KWARG, None)
        return self._novatune_stock_forward(hidden_states, position_embeddings=position_embeddings,
                                            attention_mask=attention_mask, **kwargs)
    names = self._novatune_attn
    b, s, _ = hidden_states.shape
    d = self.head_dim
    q, k, v = _project_qkv(self, names, hidden_states)
    if names.q_norm is not None and names.qk_norm_scope == "projection":
        # OLMo 2: RMSNorm over the whole (heads x head_dim) projection output, before the reshape to heads
        q, k = getattr(self, names.q_norm)(q), getattr(self, names.k_norm)(k)
    q, k, v = (t.view(b, s, -1, d) for t in (q, k, v))  # (b, s, hq, d), (b, s, hk, d), (b, s, hk, d)
    cos, sin = position_embeddings  # (b, s, r), per token: packed documents restart their positions
    if names.rope_tables == "half":
        # GPT-OSS's tables cover one half of the head and rotate (x1, x2) to (x1 c - x2 s, x2 c + x1 s): HF's
        # rotate_half rotation with each table repeated over both halves
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if self._novatune_fuse_qk_norm:
        # Qwen3: per-head RMSNorm of q and k and RoPE in one kernel each way (q, k read and written once)
        qn, kn = getattr(self, names.q_norm), getattr(self, names.k_norm)
        q, k = qk_norm_rope(q, k, qn.weight, kn.weight, self._novatune_qk_eps, cos, sin)
    else:
        if names.q_norm is not None and names.qk_norm_scope == "head":
            q = getattr(self, names.q_norm)(q)
            k = getattr(self, names.k_norm)(k)
        # tables narrower than head_dim (partial rotary, Phi-4-mini) rotate the first r features of each head
        q, k = apply_rope(q, k, cos, sin, unsqueeze_dim=2)
    hq, hk = q.shape[2], k.shape[2]
    sinks = getattr(self, names.sinks, None) if names.sinks is not None else None
    softcap = getattr(self, names.softcap, None) if names.softcap is not None else None  # Gemma 2
    out = varlen_attention(q.reshape(b * s, hq, d), k.reshape(b * s, hk, d), v.reshape(b * s, hk, d), packed,
                           scale=self.scaling, backend=self._novatune_attn_backend,
                           window=self._novatune_window, sinks=sinks, softcap=softcap)  # (b*s, hq, d)
    # flex may return a strided view
    return project(getattr(self, names.o_proj), out.reshape(b, s, hq * d), self._novatune_linear_wgrad), None


def _project_qkv(self, names, hidden_states):
    """q, k, v as (b, s, heads x head_dim) from the family's projections."""
    if names.qkv_proj is not None:
        # Phi-3: one fused projection [q | k | v]; torch.split's backward writes the three gradients into one
        # buffer. v is copied so the fused output can go once RoPE has read q and k (the attention saves v)
        qkv = project(getattr(self, names.qkv_proj), hidden_states, self._novatune_linear_wgrad)
        q, k, v = torch.split(qkv, self._novatune_qkv_split, dim=-1)
        return q, k, v.contiguous()
    projections = (getattr(self, names.q_proj), getattr(self, names.k_proj), getattr(self, names.v_proj))
    # QLoRA: the three projections in one grouped op when they all take the fused fast path (fewer launches and
    # less host time); anything else calls each module
    qkv = grouped_qlora(projections, hidden_states)
    if qkv is not None and not self._novatune_fuse_qk_norm:
        # q/k/v are blocks of one buffer; the attention saves v, and without the fused q/k-norm nothing else keeps
        # q and k (RoPE saves cos/sin only): a copy of v lets the buffer go after RoPE
        qkv = (qkv[0], qkv[1], qkv[2].contiguous())
    return qkv or tuple(project(p, hidden_states, self._novatune_linear_wgrad) for p in projections)


def decoder_pre_hook(module, args, kwargs):
    """Forward pre-hook (with_kwargs) on the decoder stack: build the PackedBatch once per batch."""
    state = module._novatune_state
    host = kwargs.pop(HOST_OFFSETS_KWARG, None)  # the collator's offsets (patch/host_offsets.py), never passed on
    if has_cache(kwargs):
        return None  # incremental decoding: stock path
    if not module.training and kwargs.get("use_cache") is not False:
        return None  # eval with the default cache (generation semantics): stock path
    if kwargs.get("output_attentions", getattr(getattr(module, "config", None), "output_attentions", False)):
        state.note_once("output_attentions", "calls with output_attentions=True use stock attention (it returns "
                                             "the attention weights, which novatune's attention never forms)")
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, dict):
        return None  # masks already prepared by the caller
    ids = kwargs.get("input_ids", args[0] if args else None)
    ref = ids if ids is not None else kwargs["inputs_embeds"]
    batch, seq = ref.shape[0], ref.shape[1]
    packed = kwargs.get(PACKED_KWARG)
    if packed is None and host is not None:
        packed = host.packed(batch, seq, ref.device)
    if packed is None:
        # a collator's host-side cu_seq_lens_q (TRL flattening, novatune's trainer) costs no device sync; CUDA
        # position_ids cost one device->host copy per batch (never one per layer)
        hf_packing = {k: kwargs[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q") if k in kwargs}
        packed = PackedBatch.from_kwargs(position_ids=kwargs.get("position_ids"), attention_mask=mask, batch=batch,
                                         device=ref.device, **hf_packing)
    if packed is None:
        if mask is not None and not bool(mask.all()):
            state.note_once("padding", "batches with padding (attention_mask zeros) use stock attention; "
                                       "pack rows (position_ids per document) for the fast path")
            return None
        # no position_ids: one document per row (what HF assumes too)
        packed = PackedBatch.from_cu_seqlens(torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32), seq,
                                             batch=batch, device=ref.device)
    kwargs[PACKED_KWARG] = packed
    if state.graphs is not None:
        state.graphs.ensure_installed()  # gradient checkpointing may have been switched on after the patch
    if module.training and kwargs.get("use_cache"):
        state.note_once("use_cache", "training forwards run with use_cache=False (a KV cache is never needed in "
                                     "training, and HF's use_cache=True disables packed-sequence detection)")
    kwargs["use_cache"] = False
    if state.all_attention_patched:
        # Every layer reads the PackedBatch, so HF's dense (seq x seq) packed mask need not be built. HF's mask
        # builder returns a 4-D mask unchanged ("already prepared"), so a 1-element 4-D placeholder skips it for
        # every family; no patched layer reads it.
        kwargs["attention_mask"] = _skip_mask_placeholder(packed.device)
    return args, kwargs


_PLACEHOLDERS: dict = {}


def _skip_mask_placeholder(device) -> torch.Tensor:
    key = str(device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    return _PLACEHOLDERS[key]
