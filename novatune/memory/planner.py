"""The memory planner: bytes and time per decoder layer under each policy, and the fastest assignment that fits.

Inputs are plain numbers (the model's shapes, the micro-batch's tokens, the card's rates), so the planner needs no
model and no GPU. Per decoder layer and micro-batch of T tokens, with b bytes per element:

  kept until the backward (bytes / T / b)      stock HF modules         novatune.patch's fused modules
    keep        every saved tensor              8h + 5q + 5kv + 4i       4h + 3q + 3kv + 3i
    lean        keep less the recomputed copies (keep: nothing offered)  keep - 2h (Qwen3: - 2h - q - kv)
    selective   input + matrix-product outputs  3h + 2q + 2kv + 2i       (the same: GEMMs and attention are kept)
    recompute   the layer's input               h                        h
    recompute_mlp  lean less the MLP's tensors    8h + 5q + 5kv            3h + 2q + 2kv (Qwen3; lean + h - 3i)
                (the MLP's input stays: its checkpoint holds it)
    offload     nothing on the device           0                        0
  h hidden, q = heads x head_dim, kv = kv_heads x head_dim, i intermediate. The stock row is HF's eager modules:
  each RMSNorm keeps an fp32 copy of its input, its normalised bf16 value and its output (4 elements per h), the
  q/k-norms the same per q and kv, RoPE's outputs and v go to attention, which keeps its output; four (T x i) MLP
  tensors. The fused row keeps each norm's input and its per-row statistics, the projections' outputs,
  attention's output, and SwiGLU's gate, up and product. Both rows match the saved-tensor bytes counted on a tiny
  Qwen3 (tests/memory/test_planner.py) within a few percent.
  A sparse MoE layer is planned as routed, i = top-k x the expert's intermediate size: novatune's expert op keeps
  its gate/up output (2i, no product; stock HF's grouped_mm path keeps 2 k h more: the gathered inputs and the
  expert outputs), and `selective` keeps none of the experts' products (their grouped GEMMs run inside one
  autograd op), so it keeps 3h + 2q + 2kv and runs the experts' forward again. A recomputed routed layer's
  backward also holds the experts' workspace on k rows per token (the larger of k h + 4i fp32 bytes + 3i and
  2i + 2 k h elements).
  Attention's log-sum-exp (fp32, per head) adds 4 x heads bytes per token to keep/lean/selective/recompute_mlp.
  While a recomputed layer runs its backward its whole `keep` set exists once more (the transient); offload adds
  two device slots of the input's size. A tiled MLP (novatune/patch/tiled.py) keeps no (T x i) tensor: only one
  chunk's five (chunk x i) tensors join the transient, and its backward runs the MLP's GEMMs once more.

  peak (evaluate)  static + kept + the largest transient, where the transients are a recomputed layer's and the
  work outside the decoder layers (the loss's logits buffer: `outside`), each at its own moment. When the layers
  run as CUDA graphs (patch/graphs.py: LoRA/QLoRA, every layer `recompute`), the graphs' shared pool takes the
  place of the eager layer transient: it holds the recompute and backward of whichever layer replays. It is a
  private pool, reserved for the graphs whatever runs, so the peak is static + the graphs' buffers + pool + kept
  + outside (measured with the pool counted, session 21: the MoE LoRA cut 13.91 GiB, of it 0.77 the pool;
  max(pool, outside) had planned 12.99). The pool is sized by its
  capture: the layer's keep set plus the gradients alive at the MLP's backward (the SwiGLU product's gradient,
  T x i, since SwiGLU writes its own gradients over gate and up; the MLP input's two partial gradients, 2 x T x h).
  Measured on the seed LoRA r16 run: a 548 MiB pool against 544 MiB from this sum (428 MiB of it the keep set).
  Forward graphs only (cuda_graphs="forward"): the pool holds a no-grad forward, bounded by the layer's keep set,
  beside the eager recompute's transient: static + buffers + pool + kept + max(transient, outside).

  time (per layer, micro-batch)  F = forward GEMM FLOPs + attention FLOPs, at the card's matmul rate
    keep       F (forward) + (1 + trained share) x F_gemm + 2 x F_attn (backward)
    lean       keep + the recomputed outputs written and their inputs read once more, at the card's bandwidth
    recompute  keep + F (the forward again)
    recompute_mlp  lean + the MLP's gate and up GEMMs again (all three for a routed or tiled MLP)
    selective  keep + the elementwise forward again (its bytes at the card's memory bandwidth); routed: + the
               experts' forward GEMMs; + SELECTIVE_DISPATCH_S, the host time of torch's selective checkpoint,
               which runs every op of the forward and the recompute through a Python dispatch mode. With it,
               selective is slower than recompute on the seed's 4096-token rows, as measured, so `auto` does not
               choose it there; on long, GPU-bound rows the GEMMs it saves can still outweigh it.
    offload    recompute + the part of each copy (input bytes at the host link's rate) that the layer's own
               forward (out) or the next layer's backward (back) does not hide, + a fixed cost per copy

`choose` searches every count of (offload, recompute, recompute_mlp, selective, keep) layers, less any policy that
another beats on bytes, time and backward transient in every layer, placed in that order from the first layer
(early layers have the longest wait before their backward, so their copies hide best; the last layers' activations
are the first the backward frees), and returns the fastest that fits the budget. Where an assignment
does not fit, the fewest of its kept layers that make it fit turn `lean` (the first kept ones).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from novatune.memory.pinned import page_rounded
from novatune.memory.policy import KEPT, POLICIES

GiB = 2**30
COPY_OVERHEAD_S = 30e-6  # events, stream switches and the copy launch of one offloaded tensor
# host time of torch's selective checkpoint per layer and micro-batch (its dispatch mode runs every op of the
# layer's forward and recompute through Python): the seed workload (Qwen3-4B, 4096-token rows, H200) measured
# 1,379 ms per step with every layer selective against 971 with every layer recomputed (bench.jsonl session21-5),
# where this model without the term planned selective 24% faster than recompute: 4.35 ms per layer per micro-batch
SELECTIVE_DISPATCH_S = 4.35e-3
GEMM_EFFICIENCY = 0.75  # share of the square-matmul rate a training step's GEMMs reach (thin LoRA ones less)

@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as the planner sees it, for one micro-batch."""
    hidden: int
    q_dim: int  # heads x head_dim
    kv_dim: int  # kv_heads x head_dim
    intermediate: int
    heads: int
    tokens: int  # tokens per micro-batch
    dtype_bytes: int
    attended_keys: float  # mean keys each query attends to (causal within documents: ~ document length / 2)
    trained_share: float = 1.0  # share of the layer's matmul weights that get gradients (LoRA: ~0)
    fused: bool = True  # novatune.patch's fused modules (False: stock HF modules)
    mlp_chunk_tokens: int | None = None  # the MLP tiled along the sequence in chunks of this many tokens
    # a routed expert MLP (sparse MoE layer): `intermediate` is what one token multiplies by (top-k x the expert's
    # intermediate size); novatune's expert op keeps its gate/up output only, and `selective` keeps none of the
    # experts' products (grouped GEMMs inside one autograd op): their forward runs again in the backward
    routed: bool = False
    top_k: int = 1  # experts per token (routed layers): the rows gathered per token in the experts' backward
    # elements per token the `lean` policy computes again in the backward instead of keeping (memory/lean_keep.py):
    # the norms' outputs (2h) and, with Qwen3's fused q/k norm + RoPE, the rotated q and k (q + kv); 0 where no op
    # offers them (stock HF modules)
    lean_elements: int = 0

    @property
    def gemm_params(self) -> int:
        h = self.hidden
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * self.intermediate


@dataclass(frozen=True)
class Hardware:
    matmul_tflops: float  # dense bf16 matmul rate (measured, or the datasheet's)
    hbm_gbps: float  # device memory bandwidth (copy rate)
    link_gbps: float  # host <-> device copy rate with pinned memory (PCIe / C2C)
    source: str = "assumed"


@dataclass(frozen=True)
class LayerCost:
    bytes: dict  # policy -> bytes kept on the device from the forward to the backward
    seconds: dict  # policy -> forward + backward time
    transient: int  # bytes a recomputed layer holds again during its backward
    input_bytes: int
    forward: float = 0.0  # the layer's forward time (seconds): a streamed weight copy hides behind forwards
    graph_pool: int = 0  # the layer's recompute + backward as a CUDA graph's pool holds it (module docstring)
    mlp_transient: int = 0  # what a recompute_mlp layer's backward holds again (its MLP's tensors, or lean's)


def saved_elements_per_token(s: LayerShape) -> dict:
    """Elements per token a layer keeps for its backward under each policy (module docstring's table)."""
    h, q, kv, i = s.hidden, s.q_dim, s.kv_dim, s.intermediate
    # the attention half (norms, projections, attention) and the MLP's own tensors (mlp_elements)
    attention = 4 * h + 3 * q + 3 * kv if s.fused else 8 * h + 5 * q + 5 * kv
    keep = attention + mlp_elements(s)
    # recompute_mlp: lean without the MLP's tensors; the MLP's input stays, held by the MLP's checkpoint: where
    # lean recomputes the norms' outputs (lean_elements, train/memory.py, counts both pre-norms' 2h) one of them,
    # the pre-MLP norm's h, comes back
    mlp_recomputed = attention - s.lean_elements + (h if s.lean_elements else 0)
    # under `selective` the matrix products' outputs are cached by the policy itself (inside a tiled MLP's chunk
    # checkpoints too, so gate and up stay); a routed MLP's products are inside one autograd op: none kept
    selective = 3 * h + 2 * q + 2 * kv + (0 if s.routed else 2 * i)
    return {"keep": keep, "lean": keep - s.lean_elements, "selective": selective, "recompute": h,
            "recompute_mlp": mlp_recomputed, "offload": 0}


def mlp_elements(s: LayerShape) -> int:
    """Elements per token the layer's MLP keeps beyond its input: fused SwiGLU gate, up and product (3i; routed:
    the experts' gate/up output, 2i: no product), stock HF's four (T x i) tensors (routed: + the gathered inputs and
    expert outputs, 2 k h, which stock's grouped_mm experts keep); no (T x i) tensor for a tiled MLP (its chunks'
    inputs are the norm output, counted with the attention half)."""
    i = 0 if s.mlp_chunk_tokens else s.intermediate
    if s.routed:
        return 2 * i if s.fused else 4 * i + 2 * s.top_k * s.hidden
    return 3 * i if s.fused else 4 * i


def layer_cost(s: LayerShape, hw: Hardware) -> LayerCost:
    per_token = saved_elements_per_token(s)
    lse = 4 * s.heads * s.tokens  # attention's fp32 log-sum-exp, kept wherever attention's forward is kept
    nbytes = {p: n * s.tokens * s.dtype_bytes + (lse if p in ("keep", "lean", "selective", "recompute_mlp") else 0)
              for p, n in per_token.items()}
    rate = hw.matmul_tflops * 1e12 * GEMM_EFFICIENCY
    gemm = 2 * s.tokens * s.gemm_params / rate
    attn = 4 * s.tokens * s.attended_keys * s.q_dim / rate
    forward = gemm + attn
    backward = (1 + s.trained_share) * gemm + 2 * attn
    elementwise = 2 * (nbytes["keep"] - nbytes["selective"]) / (hw.hbm_gbps * 1e9)  # read + write, forward
    copy = nbytes["recompute"] / (hw.link_gbps * 1e9)
    exposed = max(0.0, copy - forward) + max(0.0, copy - (forward + backward)) + 2 * COPY_OVERHEAD_S
    transient = nbytes["keep"]
    if s.mlp_chunk_tokens:
        # each chunk's MLP forward runs again in its backward; one chunk's gate, up, product and the two
        # gradients of the GEMM inputs exist at once
        backward += 2 * s.tokens * 3 * s.hidden * s.intermediate / rate
        transient += 5 * s.mlp_chunk_tokens * s.intermediate * s.dtype_bytes
    keep = forward + backward
    # a routed MLP's experts run again under `selective` (their products are not among the ops it keeps)
    routed_again = 2 * s.tokens * 3 * s.hidden * s.intermediate / rate if s.routed else 0.0
    # lean: the recomputed outputs written once more and their inputs read (the same bytes again)
    lean = 2 * (nbytes["keep"] - nbytes["lean"]) / (hw.hbm_gbps * 1e9)
    # recompute_mlp: lean's recomputed outputs, and the MLP's forward again: gate and up (torch's checkpoint stops
    # before the down projection, whose output nothing in the MLP saves); a routed MLP's experts (one autograd op)
    # and a tiled MLP (its chunks' own checkpoints inside) run all three. Not modelled: with linear_wgrad_in_place=True
    # the down projection, an autograd Function whose GEMM runs before its inputs are saved, runs too ("auto"
    # returns its gradient under the MLP's own checkpoint)
    again = 3 if s.routed or s.mlp_chunk_tokens else 2
    mlp_again = 2 * s.tokens * again * s.hidden * s.intermediate / rate
    seconds = {"keep": keep, "lean": keep + lean, "recompute": keep + forward, "recompute_mlp": keep + lean + mlp_again,
               "selective": keep + elementwise + routed_again + SELECTIVE_DISPATCH_S,
               "offload": keep + forward + exposed}
    # the MLP backward's gradients beside the keep set: the product's (a tiled MLP's chunk gradients are in its
    # transient already) and the MLP input's two partial ones
    mlp_grads = ((0 if s.mlp_chunk_tokens else s.tokens * s.intermediate) + 2 * s.tokens * s.hidden) * s.dtype_bytes
    workspace = 0
    if s.routed:
        # the experts' backward works on k rows per token (novatune/ops/moe.py): the gathered output gradient
        # (k h), the down GEMM's input gradient in fp32 (i), the GLU's gradient (2i) and weighted activation (i);
        # then the re-gathered inputs and their gradient (2 k h) beside the GLU's gradient
        b, kh = s.dtype_bytes, s.top_k * s.hidden
        workspace = s.tokens * max(kh * b + 4 * s.intermediate + 3 * s.intermediate * b,
                                   2 * s.intermediate * b + 2 * kh * b)
        transient += workspace
        mlp_grads = 2 * s.tokens * s.hidden * b
    pool = transient + mlp_grads
    # a recompute_mlp layer's backward holds the MLP's recomputed tensors (a routed MLP's with the experts'
    # workspace; a tiled MLP's one chunk of five (chunk x i) tensors), then lean's recomputed outputs
    chunk = 5 * s.mlp_chunk_tokens * s.intermediate * s.dtype_bytes if s.mlp_chunk_tokens else 0
    mlp_transient = max(mlp_elements(s) * s.tokens * s.dtype_bytes + workspace + chunk,
                        nbytes["keep"] - nbytes["lean"])
    return LayerCost(nbytes, seconds, transient, nbytes["recompute"], forward, graph_pool=pool,
                     mlp_transient=mlp_transient)


@dataclass
class Plan:
    policies: list[str]
    peak_bytes: int
    seconds: float  # decoder layers' forward + backward per micro-batch
    fits: bool
    budget_bytes: int | None
    static_bytes: int
    activation_bytes: int  # kept between forward and backward, over all layers
    transient_bytes: int  # the largest of an eagerly recomputed layer's and the outside work's (the graphs' pool
    # is in static_bytes)
    graph_pool_bytes: int = 0  # the CUDA graphs' pool, where the layers run as graphs (else 0; their buffers are
    # in static_bytes)
    outside_transient_bytes: int = 0  # the work outside the decoder layers (the loss's logits buffer)
    offloaded_bytes: int = 0  # layer inputs in page-locked host memory (whole pages)
    host_budget_bytes: int | None = None  # what they may take (None: not checked)
    lm_head_grad_in_forward: bool = False  # the loss adds lm_head's gradient into .grad (its `outside` is a chunk)

    @property
    def host_limited(self) -> bool:
        """The offloaded inputs need more pinned host memory than the host budget allows."""
        return self.host_budget_bytes is not None and self.offloaded_bytes > self.host_budget_bytes
    notes: list[str] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)  # decoder layers whose frozen weights live on the host
    stream_saved_bytes: int = 0  # device bytes streaming saves (streamed layers' weights minus the two slots)
    stream_h2d_bytes: int = 0  # host-to-device bytes it copies per micro-batch

    def counts(self) -> dict:
        return {p: self.policies.count(p) for p in POLICIES if p in self.policies}

    def describe(self) -> str:
        """Runs of equal policies: 'offload x30, keep x6' (and the streamed layers' count)."""
        runs = [(p, len(list(g))) for p, g in itertools.groupby(self.policies)]
        text = ", ".join(f"{p} x{n}" for p, n in runs)
        return text + (f"; frozen weights of {len(self.streamed)} layers streamed" if self.streamed else "")


@dataclass(frozen=True)
class FreshGradients:
    """Gradients that do not exist before the backward (one micro-batch per optimizer step: set to None after each
    step): `layer` bytes per decoder layer, born as its backward runs, and `other` (lm_head, embeddings, norms
    outside the layers), born first. With gradient accumulation they live through the later forwards instead and
    count as static."""
    layer: int
    other: int


@dataclass(frozen=True)
class HostBudget:
    """Pinned host memory the offloaded layer inputs may take (the planner never plans past it)."""
    bytes: int
    source: str


def _recomputed(policy: str) -> bool:
    return policy in ("recompute", "selective", "offload")


@dataclass(frozen=True)
class LayerGraphs:
    """The decoder layers' CUDA graphs (patch/graphs.py) as the planner sees them: `pool`, the graphs' shared
    memory pool (the largest layer's recompute + backward: LayerCost.graph_pool; forward graphs only: its keep
    set), and `buffers`, the static tensors they keep outside it beyond the layers' inputs (one more input buffer,
    and with backward graphs the two gradient buffers the layers hand each other: three (T x h) tensors)."""
    pool: int
    buffers: int
    forward_only: bool = False  # the recompute + backward run eagerly: their transient stays (module docstring)
    from_static: int = 0  # static bytes that live in the pool when the layers replay (QLoRA's dequantised weights)


def runs_as_graphs(policies: list[str], graphs: LayerGraphs | None) -> bool:
    """The layers replay as CUDA graphs: the run captures them (`graphs` given) and every layer runs the stock
    recompute, the only policy the graphs capture (any other policy sends every layer down the eager path)."""
    return graphs is not None and all(p == "recompute" for p in policies)


def evaluate(policies: list[str], costs: list[LayerCost], static_bytes: int, budget: int | None,
             fresh: FreshGradients | None = None, host: HostBudget | None = None, outside: int = 0,
             graphs: LayerGraphs | None = None) -> Plan:
    """The peak and time of one assignment: static + every layer's kept bytes + the largest transient (a layer
    recomputed in the backward, or the `outside` work: the loss) + the offload slots. `graphs`: where the run
    captures its layers as CUDA graphs (None: it never does); with every layer recomputed their pool and buffers
    join the static bytes (a private pool is reserved throughout), and backward graphs take the layers' eager
    transient into the pool (module docstring). With `fresh` gradients
    (static_bytes includes them), the peak is the largest of the end of the forward (no gradient yet; the loss
    runs then) and each layer's backward (the gradients of the layers above it born, the activations of the
    layers below it still kept). An assignment whose offloaded inputs pass the `host` budget does not fit."""
    kept_each = [c.bytes[p] for c, p in zip(costs, policies)]
    kept = sum(kept_each)
    graphed = runs_as_graphs(policies, graphs)
    pool = graphs.pool + graphs.from_static if graphed else 0
    static_bytes += graphs.buffers + graphs.pool if graphed else 0  # the pool is reserved throughout
    eager_backward = graphs is None or not graphed or graphs.forward_only  # else it runs inside the pool
    # a lean layer's backward holds its recomputed outputs again for a while (its keep set less its lean one)
    own = [_own_transient(c, p) if eager_backward or not _recomputed(p) else 0 for c, p in zip(costs, policies)]
    slots = 2 * max(c.input_bytes for c in costs) if "offload" in policies else 0
    transient = max(max(own, default=0), outside)
    peak = static_bytes + kept + transient + slots
    if fresh is not None:
        n = len(costs)
        base = static_bytes - fresh.other - n * fresh.layer
        peak = base + kept + slots + outside  # the end of the forward, where the loss runs
        below = kept
        for j in range(n - 1, -1, -1):  # the backward runs from the last layer down
            peak = max(peak, base + fresh.other + (n - j) * fresh.layer + below + own[j] + slots)
            below -= kept_each[j]
        transient = peak - base - kept - slots
    seconds = sum(c.seconds[p] for c, p in zip(costs, policies))
    fits = budget is None or peak <= budget
    # each input in a page-locked buffer of its own size (memory/pinned.py)
    offloaded = sum(page_rounded(c.input_bytes) for c, p in zip(costs, policies) if p == "offload")
    if host is not None and offloaded > host.bytes:
        fits = False
    return Plan(list(policies), peak, seconds, fits, budget, static_bytes, kept, transient, graph_pool_bytes=pool,
                outside_transient_bytes=outside, offloaded_bytes=offloaded,
                host_budget_bytes=None if host is None else host.bytes)


def choose(costs: list[LayerCost], static_bytes: int, budget: int | None,
           allowed: tuple[str, ...] = POLICIES, fresh: FreshGradients | None = None,
           host: HostBudget | None = None, outside: int = 0, graphs: LayerGraphs | None = None) -> Plan:
    """The fastest assignment that fits `budget` (module docstring); without a budget, every layer kept. When
    nothing fits, the assignment with the smallest peak, marked fits=False. `outside`, `graphs`: evaluate's."""
    n = len(costs)
    order = [p for p in ("offload", "recompute", "recompute_mlp", "selective", "keep")
             if p in allowed and all(p in c.bytes for c in costs)]
    # a policy that another beats on bytes, time and backward transient in every layer is never the better
    # choice: left out (the seed: selective). The search is over counts of each policy, so a fifth policy costs
    # ~10x (C(n + 4, 4) assignments: 91k at 36 layers); where none is dominated selective goes (its dispatch
    # mode made it slower than recompute on the seed, session21-5; memory.policy selective still asks for it)
    order = [p for p in order if not any(q != p and _dominates(q, p, costs) for q in order)]
    if len(order) > 4:
        order.remove("selective")
    leaner = "lean" in allowed and any(c.bytes.get("lean", c.bytes["keep"]) < c.bytes["keep"] for c in costs)
    best: Plan | None = None
    smallest: Plan | None = None
    for counts in _compositions(n, len(order)):
        policies = [p for p, k in zip(order, counts) for _ in range(k)]
        plan = evaluate(policies, costs, static_bytes, budget, fresh, host, outside, graphs)
        if leaner and not plan.fits and "keep" in policies:
            plan = _fewest_lean(policies, costs, static_bytes, budget, fresh, host, outside, graphs)
        if smallest is None or plan.peak_bytes < smallest.peak_bytes:
            smallest = plan
        if plan.fits and (best is None or plan.seconds < best.seconds
                          or (plan.seconds == best.seconds and plan.peak_bytes < best.peak_bytes)):
            best = plan
    return best if best is not None else smallest


def _own_transient(c: LayerCost, policy: str) -> int:
    """What a layer under `policy` holds again in its eager backward (evaluate's `own`)."""
    if _recomputed(policy):
        return c.transient
    if policy == "lean":
        return c.bytes["keep"] - c.bytes["lean"]
    return c.mlp_transient if policy == "recompute_mlp" else 0


def _dominates(q: str, p: str, costs: list[LayerCost]) -> bool:
    """q is never worse than p in any layer (bytes, time, backward transient) and better somewhere: equal
    policies both stay."""
    pairs = [((c.bytes[q], c.seconds[q], _own_transient(c, q)), (c.bytes[p], c.seconds[p], _own_transient(c, p)))
             for c in costs]
    return all(a <= b for x, y in pairs for a, b in zip(x, y)) and any(x != y for x, y in pairs)


def _fewest_lean(policies: list[str], costs: list[LayerCost], static_bytes: int, budget: int | None,
                 fresh: FreshGradients | None, host: HostBudget | None, outside: int,
                 graphs: LayerGraphs | None) -> Plan:
    """The assignment with the fewest of its kept layers `lean` (the first ones) that fits, or all of them lean
    when none does: a lean layer is a little slower than a kept one and never holds more, so the peak falls as
    the count grows and the fastest fit is the smallest count (found by bisection)."""
    first = policies.index("keep")
    kept = len(policies) - first

    def with_lean(j: int) -> Plan:
        return evaluate(policies[:first] + ["lean"] * j + ["keep"] * (kept - j), costs, static_bytes, budget,
                        fresh, host, outside, graphs)

    most = with_lean(kept)
    if not most.fits:
        return most
    lo, hi = 1, kept
    while lo < hi:
        mid = (lo + hi) // 2
        if with_lean(mid).fits:
            hi = mid
        else:
            lo = mid + 1
    return with_lean(lo)


def _compositions(n: int, parts: int):
    """Every tuple of `parts` non-negative counts summing to n."""
    if parts == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, parts - 1):
            yield (first, *rest)


# ---------------------------------------------------------------------------------------- frozen-weight streaming
@dataclass(frozen=True)
class FrozenStream:
    """Frozen-weight streaming (memory/stream.py) as the planner sees it: each streamed layer's frozen weights
    (`layer_bytes`) leave the device; two slots of one layer's size stay; each copy runs at `link_gbps`."""
    layer_bytes: int
    link_gbps: float


def spread(candidates: list[int], count: int) -> list[int]:
    """`count` of the candidate layers, spread evenly: each streamed layer's copy then overlaps the layers between
    it and the previous streamed one."""
    if count <= 0:
        return []
    if count >= len(candidates):
        return list(candidates)
    step = len(candidates) / count
    return [candidates[int(j * step)] for j in range(count)]


def stream_seconds(costs: list[LayerCost], policies: list[str], streamed: list[int], fs: FrozenStream) -> float:
    """Copy time streaming leaves exposed per micro-batch. Forward: streamed layer j's copy starts with layer
    j - 1's forward and must end by its own (windows: the forwards in between). Backward: layer j - 1's copy starts
    with layer j's recompute (windows: the backwards in between). The backward ends with the first two streamed
    layers in their slots, the last two are there from the forward: 2K - 4 copies."""
    if len(streamed) < 3:
        return 0.0
    copy = fs.layer_bytes / (fs.link_gbps * 1e9)
    fwd = [c.forward for c in costs]
    bwd = [c.seconds[p] - c.forward for c, p in zip(costs, policies)]
    exposed = 0.0
    for j in range(2, len(streamed)):  # forward copies of streamed layers 2..K-1
        exposed += max(0.0, copy - sum(fwd[streamed[j - 1]:streamed[j]])) + COPY_OVERHEAD_S
    for j in range(len(streamed) - 2, 0, -1):  # backward copies of streamed layers K-3..0
        exposed += max(0.0, copy - sum(bwd[streamed[j - 1] + 1:streamed[j] + 1])) + COPY_OVERHEAD_S
    return exposed


def with_streaming(plan: Plan, costs: list[LayerCost], count: int, fs: FrozenStream,
                   host: HostBudget | None = None) -> Plan:
    """The plan with `count` of its recomputed layers streaming their frozen weights (spread apart): the peak
    drops by their weights minus two slots, the time grows by the exposed copies."""
    candidates = [i for i, p in enumerate(plan.policies) if p not in KEPT]
    if count > len(candidates):
        raise ValueError(f"{count} layers to stream but only {len(candidates)} are recomputed (streaming needs the "
                         f"recompute to bring a layer's weights back for its backward)")
    streamed = spread(candidates, count)
    saved = (len(streamed) - 2) * fs.layer_bytes if streamed else 0
    seconds = plan.seconds + stream_seconds(costs, plan.policies, streamed, fs)
    peak = plan.peak_bytes - saved
    host_bytes = plan.offloaded_bytes + len(streamed) * fs.layer_bytes
    fits = (plan.budget_bytes is None or peak <= plan.budget_bytes) and (host is None or host_bytes <= host.bytes)
    copies = max(0, 2 * len(streamed) - 4) if len(streamed) > 2 else 0
    return replace(plan, peak_bytes=peak, seconds=seconds, fits=fits, static_bytes=plan.static_bytes - saved,
                   streamed=streamed, stream_saved_bytes=saved, stream_h2d_bytes=copies * fs.layer_bytes,
                   notes=list(plan.notes))


def fewest_streamed(make_plan, costs: list[LayerCost], n: int, fs: FrozenStream,
                    host: HostBudget | None = None) -> Plan | None:
    """The plan that streams the fewest layers and fits, or None. `make_plan(saved_bytes)` gives the policies'
    plan for a static size `saved_bytes` smaller (auto re-chooses its policies with the room streaming makes)."""
    def plan_for(k: int) -> Plan | None:
        saved = (k - 2) * fs.layer_bytes
        base = make_plan(saved)
        if sum(p not in KEPT for p in base.policies) < k:
            return None  # too few recomputed layers to stream k
        base = replace(base, peak_bytes=base.peak_bytes + saved, static_bytes=base.static_bytes + saved)
        return with_streaming(base, costs, k, fs, host)

    def fits(k: int) -> bool:
        plan = plan_for(k)
        return plan is not None and plan.fits

    lo, hi = 3, n  # fewer than three streamed layers save nothing (two slots stay)
    if hi < lo or not fits(hi):
        return None
    while lo < hi:  # more streamed layers never need more memory: the fewest that fit by bisection
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return plan_for(lo)
