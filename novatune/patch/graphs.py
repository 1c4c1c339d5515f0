"""CUDA graphs for gradient-checkpointed decoder layers: each layer's forward, and (unless only the forward is asked
for) its recompute + backward, replayed from a captured graph instead of being launched op by op from Python.

Why: a QLoRA micro-step (Qwen3-8B, 2048 tokens, H200) took 372 ms of wall time for 180 ms of GPU work
(LOG.md run 30): the host could not issue ~40 launches per layer per pass through autograd fast enough. A graph
replay costs a few µs of host time per layer.

Captured per decoder layer i, lazily, during the first eligible batch (after one eager warm-up batch):
  forward   no grad: xs[i] -> layer -> xs[i+1]        (the checkpointed forward: it saves nothing)
  backward  grad:    xs[i] -> layer (recompute) -> autograd.grad w.r.t. (xs[i], the layer's trainable
                     parameters) with grad_output gbuf[i % 2]; dx into gbuf[(i+1) % 2], the parameter
                     gradients into one static set shared by every layer of the same parameter shapes
xs[0..L] hold the layers' inputs, which eager checkpointing keeps anyway (same memory); the gradient pair and the
parameter-gradient set are one layer's worth. All graphs share one memory pool: a graph's temporaries are dead
when its replay ends, and its outputs are read right after the replay, so the replay order does not matter.

Per batch, at the first layer's call: cos/sin, position_ids and the document offsets are copied into static
buffers. The offsets are padded with empty documents to a power-of-two slot count (at least 16), and max_seqlen
rounded up to half or all of the batch's tokens: one set of graphs per (slots, max_seqlen) bucket, at most
MAX_BUCKETS; both max_seqlen buckets of a slot count are captured in the same batch. Layer i then replays its forward
graph inside an autograd Function whose backward replays the backward graph and returns fresh gradient tensors,
so AccumulateGrad, gradient accumulation and parameter hooks work as in eager mode.

Forward graphs only (cuda_graphs="forward", opt-in): layer i replays its no-grad forward from a graph; its backward
recomputes the layer eagerly from xs[i] and runs autograd through it (graph_recompute.py): the parameters'
gradients go back to autograd as eager mode's do, or, where autograd would add them into an existing .grad with
nothing watching, a nested backward adds them there (no static gradient set, no copies out of a graph). The
recompute attends over the batch's own document offsets
(the same values as the padded ones, test_padded_offsets_attend_like_the_batch, and FlashAttention's backward grid
spans the batch's documents, not the padded slots); a one-document row, where eager attention picks another
kernel, recomputes on the graph's static inputs. On the seed workload (H200) they removed the forward's host idle
and still ran 3-4% slower than eager layers (LOG.md, session 21): the recompute runs the whole layer, where the
stock checkpoint stops after the last tensor its backward needs (one down-projection GEMM per layer fewer). So
"auto" keeps full fine-tuning eager; a host too slow for its GPU may gain from them.

A batch runs the stock checkpointed layers instead (said once per reason in the report) when: the tensors are
not on CUDA, grad is off, the attention is not novatune's varlen path for every layer, a module in the layers has
hooks or an active dropout (random draws), a memory policy other than recompute is on a layer, most of a layer
trains under adapter graphs (their gradient copies cost full fine-tuning more than they save), the batch shape
differs from the first capture's, a layer keyword is a tensor the graphs would freeze, a parameter was replaced,
or an earlier batch's backward is still pending (a second forward before backward).
"""
from __future__ import annotations

import contextlib
import functools
import os
import traceback
import weakref

import torch
from torch import Tensor, nn

from novatune.attention import backends
from novatune.attention.packed import PackedBatch
from novatune.patch.forwards import PACKED_KWARG
from novatune.patch.graph_recompute import Recompute, parameters_as, recompute_backward
from novatune.patch.moe import outputs_unread

WARMUP_BATCHES = 1      # eager batches before the first capture: Triton compiles, cuBLAS picks its kernels
MAX_BUCKETS = 8         # (slots, max_seqlen) graph sets kept; batches beyond them run eagerly
# coarse buckets, so a run captures once or twice: 16 document slots hold a 4096-token row of median-600-token
# documents; max_seqlen is T/2 or T (T = tokens per batch). Unused slots and blocks past a document's end cost
# FlashAttention only early-exiting programs. (At 8 slots the MoE LoRA bench captured twice, once inside its
# timed steps: 57,768 tok/s in session21-3 against 62,700 in session20-4, another call.)
MIN_SLOTS = 16
MAX_TRAINABLE_FRACTION = 0.25
# "thread_local" lets other threads (a data loader's pin-memory thread) make CUDA calls during a capture
CAPTURE_MODE = os.environ.get("NOVATUNE_GRAPH_CAPTURE_MODE", "thread_local")
# the attention backends a capture may hold: FlashAttention-2's varlen kernels (torch's varlen_attn, or the same
# kernels through aten's ops), which read the document offsets from the static buffers the graphs refill per batch
GRAPH_BACKENDS = frozenset({"varlen", "flash"})
# keywords HF hands every layer that novatune's layers never read on the GPU (the PackedBatch holds them)
HOST_KWARGS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})


def _pow2_at_least(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


class _Token:
    """Alive while a layer of the newest graphed batch still awaits its backward (each layer's ctx holds it)."""


class _LayerGraphs:
    """One layer's captured forward and backward for one bucket, and the static tensors they read and write."""

    def __init__(self, fwd, bwd, out: Tensor, gout: Tensor, gx: Tensor, x_grad: bool, grads: list[Tensor],
                 grad_index: list[int], n_params: int, recompute=None):
        self.fwd, self.bwd, self.out, self.gout, self.gx, self.x_grad = fwd, bwd, out, gout, gx, x_grad
        self.grads, self.grad_index, self.n_params = grads, grad_index, n_params
        self.recompute = recompute  # forward graphs only (bwd None): the layer's call on the static inputs
        self.before = None  # called before each replay (a streamed layer's weights: memory/stream.py)


class _GraphedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner, lg: _LayerGraphs, batch_id: int, token: _Token, recompute: Recompute | None, x,
                *params):
        if lg.before is not None:
            lg.before()
        lg.fwd.replay()
        ctx.runner, ctx.lg, ctx.batch_id, ctx.token, ctx.recompute = runner, lg, batch_id, token, recompute
        return lg.out.detach()  # a new tensor object over the static buffer: the next layer's xs[i+1]

    @staticmethod
    def backward(ctx, gout):
        runner, lg = ctx.runner, ctx.lg
        if ctx.batch_id != runner.batch_id:
            raise RuntimeError("novatune CUDA graphs: a layer's backward ran after a newer batch's forward had "
                               "overwritten the graphs' static inputs (a second backward with retain_graph=True "
                               "after another forward?); patch with cuda_graphs=False for that pattern")
        if lg.before is not None:
            lg.before()
        if lg.bwd is None:
            ctx.token = None
            gx, grads = recompute_backward(ctx.recompute, gout)
            return (None, None, None, None, None, gx, *grads)
        if gout.data_ptr() != lg.gout.data_ptr() or gout.stride() != lg.gout.stride():
            lg.gout.copy_(gout)
        lg.bwd.replay()
        # fresh tensors: the static ones are overwritten by the next layer's replay
        fresh = torch._foreach_mul(lg.grads, 1.0) if lg.grads else []
        grads = [None] * lg.n_params
        for j, g in zip(lg.grad_index, fresh):
            grads[j] = g
        ctx.token = None
        return (None, None, None, None, None, lg.gx.detach() if lg.x_grad else None, *grads)


class _Bucket:
    def __init__(self, slots: int, max_seqlen: int, batch: int, seq_len: int, device):
        self.cu = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.packed = PackedBatch.graph_static(self.cu, max_seqlen, batch, seq_len)
        self.slots = slots
        self.layers: dict[int, _LayerGraphs] = {}
        self.siblings: list[_Bucket] = []


class _CheckpointHook:
    """Stands in for a layer's `_gradient_checkpointing_func` (HF calls it as func(partial(forward, **kw), x))."""

    def __init__(self, runner: LayerGraphRunner, index: int, inner):
        self.runner, self.index, self.inner = runner, index, inner

    def __call__(self, fn, *args, **kwargs):
        return self.runner.call(self.index, self.inner, fn, args, kwargs)


class LayerGraphRunner:
    """The graphs of one model's decoder layers (novatune.patch(cuda_graphs=...) installs one per model)."""

    def __init__(self, layers: list[nn.Module], state, full_training: bool, forward_only: bool = False):
        self.layers, self.state, self.full_training = layers, state, full_training
        self.forward_only = forward_only  # graphs of the no-grad forward only; recompute + backward eager
        self.batch_id = 0
        self.mode = "eager"
        self.current_packed = None
        self.token: _Token | None = None
        self.token_ref = None
        self.broken: str | None = None
        self.broken_trace = ""  # the capture error's stack (stats(); the report keeps the one-line reason)
        self.warm_batches = 0
        self.captured_batches = 0
        # The allocator's cache is released once before each capture batch: a capture cannot hand cached blocks
        # back to the driver itself, so on a nearly full card (or under a memory cap) the graphs' pool would find
        # no room while the eager pool's cache holds it. Counted, with the out-of-memory retries, in stats().
        self.release_cache = False
        self.cache_releases = 0
        self.refused: str | None = None  # a reason set by whoever wraps the model (keep_layers_eager)
        self.pool_graphs = 0  # graphs captured into self.pool
        self.replayed_batches = 0
        self.eager_batches = 0
        self.shape = None
        self.xs = self.gbufs = self.cos = self.sin = self.pos = None
        self.pool = self.stream = None
        self.warmed = False
        self.buckets: dict[tuple, _Bucket] = {}
        self.bucket: _Bucket | None = None
        self.layer_params: list[list[Tensor]] = []
        self.layer_slots: list[list[tuple]] = []  # (module, name) of each trainable parameter
        self.signature = None
        self.grad_sets: dict[tuple, list[Tensor]] = {}
        self.before_replay: list = []

    # ------------------------------------------------------------------------------------------ installation
    def ensure_installed(self) -> None:
        """Wrap each layer's checkpoint function (HF sets it in gradient_checkpointing_enable, maybe after the
        patch): called by the decoder stack's pre-hook once per batch."""
        for i, layer in enumerate(self.layers):
            f = layer.__dict__.get("_gradient_checkpointing_func")
            if f is not None and not isinstance(f, _CheckpointHook):
                layer.__dict__["_gradient_checkpointing_func"] = _CheckpointHook(self, i, f)

    def uninstall(self) -> None:
        for layer in self.layers:
            f = layer.__dict__.get("_gradient_checkpointing_func")
            if isinstance(f, _CheckpointHook):
                layer.__dict__["_gradient_checkpointing_func"] = f.inner
        self.buckets.clear()

    def stats(self) -> dict:
        return {"captured_batches": self.captured_batches, "replayed_batches": self.replayed_batches,
                "cache_releases": self.cache_releases,
                "eager_batches": self.eager_batches, "buckets": sorted(k[:2] for k in self.buckets),
                "broken": self.broken, "broken_trace": self.broken_trace}

    # ------------------------------------------------------------------------------------------ per call
    def call(self, i: int, inner, fn, args, kwargs):
        if kwargs or len(args) != 1 or not isinstance(fn, functools.partial):
            return inner(fn, *args, **kwargs)
        x = args[0]
        packed = fn.keywords.get(PACKED_KWARG)
        if i == 0 or packed is not self.current_packed:
            self._begin(i, fn, x, packed)
        if self.mode == "graphs" and x.shape == self.shape[0]:
            try:
                return self._run(i, fn, x)
            except _Unsupported as e:
                self.broken_trace = "".join(traceback.format_exception(e.__cause__ or e)[-12:])
                self._break(str(e))
        return inner(fn, *args)

    def _note(self, why: str) -> None:
        self.state.note_once(f"cuda_graphs: {why}", f"CUDA graphs: {why}; such batches ran the stock "
                                                    f"checkpointed layers")

    def _break(self, why: str) -> None:
        self.broken, self.mode = why, "eager"
        self.buckets.clear()
        # the static buffers go too (layers already replayed in this batch keep their own references)
        self.xs = self.gbufs = self.cos = self.sin = self.pos = None
        self.grad_sets.clear()
        self.state.note_once("cuda_graphs broken", f"CUDA graphs turned off for this model: {why}")

    def _begin(self, i: int, fn, x: Tensor, packed) -> None:
        self.current_packed, self.mode, self.token = packed, "eager", None
        why = self._why_not(i, fn, x, packed)
        if why is None and self.warm_batches < WARMUP_BATCHES:
            self.warm_batches += 1
            why = ""  # warm-up: eager on purpose, nothing to report
        if why is None:
            why = self._check_layers()
        if why is None:
            bucket = self._bucket_for(x, packed)
            if bucket is None:
                why = f"more than {MAX_BUCKETS} (documents, longest document) buckets"
            else:
                self._load(fn, x, packed, bucket)
                return
        self.eager_batches += 1
        if why:
            self._note(why)

    def _why_not(self, i: int, fn, x: Tensor, packed) -> str | None:
        if self.broken is not None:
            return self.broken
        if x.device.type != "cuda":
            return f"hidden states on {x.device.type}"
        if not torch.is_grad_enabled():
            return "grad disabled"
        if torch.cuda.is_current_stream_capturing():
            return "called inside another CUDA graph capture"
        if packed is None or i != 0:
            return "no packed-row metadata for the batch (novatune's attention forward did not run)"
        if not self.state.all_attention_patched:
            return "not every attention layer is novatune's"
        if self.state.tiling is not None and self.state.tiling.applies(x):
            return "the MLP is tiled at this row length (a long batch is GPU-bound: graphs gain nothing)"
        if self.shape is not None and (x.shape, x.dtype) != self.shape:
            return f"batch shape {tuple(x.shape)} differs from the captured {tuple(self.shape[0])}"
        if self.token_ref is not None and self.token_ref() is not None:
            return "a second forward before the previous batch's backward"
        for k, v in fn.keywords.items():
            if k == "position_embeddings":
                if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(t, Tensor) and t.is_cuda for t in v)):
                    return "position_embeddings are not a (cos, sin) pair of CUDA tensors"
            elif k in ("position_ids", PACKED_KWARG) or k in HOST_KWARGS:
                continue
            elif k == "attention_mask":
                if isinstance(v, Tensor) and v.numel() != 1:
                    return "a dense attention mask reaches the layers"
            elif isinstance(v, Tensor) or not (v is None or isinstance(v, (bool, int, float, str))):
                return f"layer keyword {k!r} ({type(v).__name__}) would be frozen into the graphs"
        return None

    def _check_layers(self) -> str | None:
        """Hooks, dropout, trainable share; the parameters' identity and storage (a replaced weight invalidates
        every graph that read it)."""
        if self.refused is not None:
            return self.refused
        if _global_hooks():
            return "global module hooks are registered"
        for layer in self.layers:
            hook = layer.__dict__.get("_gradient_checkpointing_func")
            if not getattr(getattr(hook, "inner", hook), "graphs_compatible", True):
                return "a memory policy keeps or offloads some layers' activations (the graphs capture the " \
                       "stock recompute only)"
        self.before_replay = [_before_replay(layer) for layer in self.layers]
        params, slots, sig = [], [], []
        for layer in self.layers:
            mine, where, total, trained = [], [], 0, 0
            for m in layer.modules():
                pre = [h for h in m._forward_pre_hooks.values() if not (m is layer and _graph_safe(h))]
                if m._forward_hooks or pre or m._backward_hooks or m._backward_pre_hooks:
                    return f"module hooks on {type(m).__name__} (they would run only at capture)"
                if isinstance(m, nn.Dropout) and m.training and m.p > 0:
                    return "an active dropout in the layers (random draws; LoRA dropout keeps PEFT's exact path)"
                for k, p in m._parameters.items():
                    if p is None:
                        continue
                    sig.append((id(p), p.data_ptr(), p.requires_grad))
                    total += p.numel()
                    if p.requires_grad:
                        mine.append(p)
                        where.append((m, k))
                        trained += p.numel()
            if not self.full_training and trained > MAX_TRAINABLE_FRACTION * total:
                return "most of each layer trains (full fine-tuning is GPU-bound; pass cuda_graphs=True to force)"
            params.append(mine)
            slots.append(where)
        sig = tuple(sig)
        if sig != self.signature:
            self.buckets.clear()  # parameters replaced, moved or (un)frozen: every graph is stale
            self.signature, self.layer_params, self.layer_slots = sig, params, slots
        return None

    def _bucket_for(self, x: Tensor, packed: PackedBatch) -> _Bucket | None:
        slots = _pow2_at_least(packed.num_docs, MIN_SLOTS)
        longest = packed.total_tokens if 2 * packed.max_seqlen > packed.total_tokens else packed.total_tokens // 2
        t = packed.total_tokens
        bucket = self._get_bucket((slots, longest, x.requires_grad), x, packed)
        other = self._get_bucket((slots, t // 2 if longest == t else t, x.requires_grad), x, packed)
        if bucket is not None and other is not None and other is not bucket:
            bucket.siblings = [other]  # captured together: the other one's first batch may be a timed one
        return bucket

    def _get_bucket(self, key: tuple, x: Tensor, packed: PackedBatch) -> _Bucket | None:
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= MAX_BUCKETS or key[1] < 1:
                return None
            if self.xs is None:
                self._allocate(x)
            bucket = self.buckets[key] = _Bucket(key[0], key[1], packed.batch, packed.seq_len, x.device)
        return bucket

    def _allocate(self, x: Tensor) -> None:
        self.shape = (x.shape, x.dtype)
        self.xs = [torch.empty_like(x) for _ in range(len(self.layers) + 1)]
        self.gbufs = [x[:0], x[:0]] if self.forward_only else [torch.empty_like(x), torch.empty_like(x)]
        self.pool, self.pool_graphs = torch.cuda.graph_pool_handle(), 0
        self.stream = torch.cuda.Stream(device=x.device)

    def _load(self, fn, x: Tensor, packed: PackedBatch, bucket: _Bucket) -> None:
        """Copy this batch's dynamic inputs into the static buffers the graphs read."""
        cos, sin = fn.keywords["position_embeddings"]
        if self.cos is None or self.cos.shape != cos.shape:
            self.cos, self.sin = torch.empty_like(cos), torch.empty_like(sin)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        pos = fn.keywords.get("position_ids")
        if isinstance(pos, Tensor) and pos.is_cuda:
            if self.pos is None or self.pos.shape != pos.shape:
                self.pos = torch.empty_like(pos)
            self.pos.copy_(pos)
        # the PackedBatch's device offsets (its one H2D copy is already queued), then empty documents to the end
        n = packed.num_docs + 1
        bucket.cu[:n].copy_(packed.cu_seqlens)
        bucket.cu[n:].fill_(packed.total_tokens)
        self.bucket, self.mode = bucket, "graphs"
        self.batch_id += 1
        self.token = _Token()
        self.token_ref = weakref.ref(self.token)
        if len(bucket.layers) == len(self.layers):
            self.replayed_batches += 1
        else:
            self.captured_batches += 1
            self.release_cache = True

    def _run(self, i: int, fn, x: Tensor) -> Tensor:
        bucket = self.bucket
        xs_i = self.xs[i]
        if x.data_ptr() != xs_i.data_ptr():
            xs_i.copy_(x)  # the first layer (embeddings); later layers get the previous graph's output buffer
        lg = bucket.layers.get(i)
        before = self.before_replay[i]
        if before is not None:
            before()  # the weights a capture's warm-up runs on
        if lg is None:
            lg = bucket.layers[i] = self._capture(i, fn, x.requires_grad, bucket)
            for sib in bucket.siblings:
                if i not in sib.layers:
                    sib.layers[i] = self._capture(i, fn, x.requires_grad, sib)
        elif lg.x_grad != x.requires_grad:
            raise _Unsupported("a layer input's requires_grad changed between batches")
        lg.before = before
        rc = None
        if self.forward_only:  # the recompute takes the batch's own offsets, except a one-document row (docstring)
            rc = Recompute(lg.recompute if self.current_packed.one_doc_per_row else fn, self.xs[i],
                            self.layer_params[i], self.layer_slots[i], lg.x_grad)
        out = _GraphedLayer.apply(self, lg, self.batch_id, self.token, rc, x, *self.layer_params[i])
        if i == len(self.layers) - 1:
            self.token = None  # from here only the layers' autograd nodes keep the batch alive
        return out

    # ------------------------------------------------------------------------------------------ capture
    def _capture(self, i: int, fn, x_grad: bool, bucket: _Bucket) -> _LayerGraphs:
        kw = dict(fn.keywords)
        kw["position_embeddings"] = (self.cos, self.sin)
        if isinstance(kw.get("position_ids"), Tensor) and kw["position_ids"].is_cuda:
            kw["position_ids"] = self.pos
        kw[PACKED_KWARG] = bucket.packed
        call = functools.partial(fn.func, *fn.args, **kw)
        params = self.layer_params[i]
        src, out = self.xs[i], self.xs[i + 1]
        gout, gx = self.gbufs[i % 2], self.gbufs[(i + 1) % 2]

        slots = self.layer_slots[i]

        def backward_pass():
            # Fresh leaves stand in for the trainable parameters (same storage): autograd syncs each input's
            # gradient-accumulator stream back to the caller's, and the parameters' own accumulators were made
            # on the default stream by eager batches; an event on that stream would invalidate the capture.
            xin = src.detach().requires_grad_(x_grad)
            alias = [p.detach().requires_grad_(True) for p in params]
            # y only roots the backward: its values are never read (MoE experts may skip what produces nothing else)
            with parameters_as(slots, params, alias), torch.enable_grad(), outputs_unread():
                y = call(xin)
            return torch.autograd.grad(y, ([xin] if x_grad else []) + alias, grad_outputs=gout,
                                       allow_unused=True)

        statics = [] if self.forward_only else self._grad_set(params)
        stage = "warm-up"
        with backends.isolated_choices() as seen:
            for attempt in (1, 2):
                if self.release_cache:
                    self._release_cache()
                try:
                    if not self.warmed:
                        self._warm_up(call, src, None if self.forward_only else backward_pass)
                    fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                    stage = "forward"
                    with self._capturing(fwd):
                        with torch.no_grad():
                            out.copy_(call(src))
                    if self.forward_only:
                        self.pool_graphs += 1
                        break
                    stage = "backward"
                    with self._capturing(bwd):
                        grads = list(backward_pass())
                        if x_grad:
                            gx.copy_(grads.pop(0))
                        index = [j for j, g in enumerate(grads) if g is not None]
                        for j in index:
                            statics[j].copy_(grads[j])
                        del grads
                    self.pool_graphs += 2
                    break
                except torch.OutOfMemoryError as e:
                    # A retry needs a pool no failed capture has touched; one graphs already live in cannot be
                    # swapped, so out of memory there turns the graphs off.
                    if attempt == 2 or self.pool_graphs:
                        raise _Unsupported(f"capturing layer {i} ({stage}) ran out of memory: "
                                           f"{str(e).splitlines()[0][:200]}") from e
                    fwd = bwd = None
                    self.pool = torch.cuda.graph_pool_handle()
                    self.release_cache = True
                except Exception as e:  # noqa: BLE001 - an automatic speed-up: fall back and say why
                    raise _Unsupported(f"capturing layer {i} ({stage}) raised {type(e).__name__}: "
                                       f"{str(e).splitlines()[0][:200] if str(e) else ''}") from e
        ran = {c.backend for c in seen}
        if not ran or not ran <= GRAPH_BACKENDS:
            raise _Unsupported(f"the captured attention ran {sorted(ran) or 'nothing'}, not FlashAttention-2's "
                               f"varlen kernels ({sorted(GRAPH_BACKENDS)}: only they read the padded static "
                               "document offsets)")
        if self.forward_only:
            return _LayerGraphs(fwd, None, out, gout, gx, x_grad, [], [], len(params), recompute=call)
        return _LayerGraphs(fwd, bwd, out, gout, gx, x_grad, [statics[j] for j in index], index, len(params))

    def _release_cache(self) -> None:
        self.release_cache = False
        self.cache_releases += 1
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    @contextlib.contextmanager
    def _capturing(self, graph):
        """torch.cuda.graph without its device sync, garbage collection and empty_cache: 72 captures of a
        36-layer model would otherwise hand every cached block back to the driver (and re-allocate it) each
        time. The capture stream waits for the current one, so the graph's inputs are ordered as usual."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_MODE)
            try:
                yield
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)

    def _grad_set(self, params: list[Tensor]) -> list[Tensor]:
        key = tuple((tuple(p.shape), p.dtype, p.device) for p in params)
        if key not in self.grad_sets:
            self.grad_sets[key] = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
        return self.grad_sets[key]

    def _warm_up(self, call, src: Tensor, backward_pass) -> None:
        """One eager forward + backward on the capture stream: lazy per-stream state (cuBLAS workspaces) is
        created here, not inside a graph."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            with torch.no_grad():
                call(src)
            if backward_pass is not None:
                backward_pass()
        current.wait_stream(self.stream)
        self.warmed = True


class _Unsupported(RuntimeError):
    pass


def _graph_safe(hook) -> bool:
    """A decoder layer's own forward pre-hook that says it may stay (it runs outside the layer's checkpoint, so
    outside the graphs, at every batch): memory/stream.py's weight streaming."""
    return bool(getattr(hook, "graph_safe", False))


def _before_replay(layer: nn.Module):
    """The `before_replay()` of whatever wraps the layer's checkpoint function (memory/stream.py brings a streamed
    layer's weights to the GPU with it), or None."""
    f = layer.__dict__.get("_gradient_checkpointing_func")
    while f is not None:
        if callable(getattr(f, "before_replay", None)):
            return f.before_replay
        f = getattr(f, "inner", None)
    return None


def _global_hooks() -> bool:
    from torch.nn.modules import module as m

    return bool(m._global_forward_pre_hooks or m._global_forward_hooks or m._global_backward_hooks
                or getattr(m, "_global_backward_pre_hooks", None))
