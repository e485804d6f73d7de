"""Mixture-of-experts MLP: a router picks top-k experts per token, each expert is a gated
MLP (SwiGLU, or gpt-oss's clamped variant with biases), and a token's output is the
routing-weighted sum of its experts' outputs.

Expert weights are stacked, `w13` [E, 2I, H] (gate rows then up rows) and `w2` [E, H, I],
so one parameter holds every expert and a grouped kernel can index it. Checkpoints store
one tensor per expert and projection; `expert_weight_target` maps those names to a
(stacked parameter, (expert, half)) shard, which the layer's weight loader copies in.
"""
from __future__ import annotations

import re
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.distributed.parallel import Span, all_reduce, even_span
from tessera.ops.linear import Linear
from tessera.ops.linear_int4 import StoredInt4
from tessera.ops.module import OpModule
from tessera.ops.registry import OpLookupError, OpTarget, builders, register_op, select_op
from tessera.ops.weights import copy_checked, make_param, prepared_param
from tessera.weights.lazy import materialize, narrow


@register_op("moe_routing", name="torch_softmax_topk", priority=0)
def softmax_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                     expert_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, k] float32, expert ids [T, k]). Softmax in float32 over all experts,
    then top-k; `renormalize` rescales the k weights to sum to 1 (Mixtral always,
    Qwen3-MoE when norm_topk_prob); `expert_scales` [E] then multiplies each weight by its
    expert's (Gemma 4's per_expert_scale)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_scales is not None:
        weights = weights * expert_scales[ids]
    return weights, ids


@register_op("moe_scored_routing", name="torch_scored_topk", priority=0)
def scored_topk_ref(logits: torch.Tensor, top_k: int, sigmoid: bool = False, bias: torch.Tensor | None = None,
                    groups: int = 1, topk_group: int = 1, group_rule: str = "top2_sum", renormalize: bool = False,
                    renorm_eps: float = 0.0, renorm_floor: float = 0.0, scaling: float = 1.0,
                    router_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, k] float32, expert ids [T, k]) of the routers softmax_topk_ref does not
    cover (DeepSeek V2 / V3, GLM-4.5, MiniMax-M2, Nemotron 3, Mistral 4, ERNIE 4.5, LFM2-MoE).
    `logits` [T, E], or with `router_weight` [E, H] (float32) the hidden rows [T, H]: the
    logits are then x W^T in float32. Scores: softmax or sigmoid in float32. The choice adds
    `bias`; with `groups`, only the `topk_group` groups whose best choice ("max") or best
    two's sum ("top2_sum") is largest stay eligible. The weights are the chosen scores
    (without the bias), over max(sum, renorm_floor) + renorm_eps when `renormalize`, times
    `scaling`."""
    if router_weight is not None:
        logits = F.linear(logits.float(), router_weight)
    logits = logits.float()
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if groups > 1:
        per_group = choice.view(choice.shape[0], groups, -1)
        group_scores = (per_group.max(dim=-1).values if group_rule == "max"
                        else per_group.topk(2, dim=-1)[0].sum(dim=-1))
        choice = keep_groups(choice, group_scores, topk_group, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True).clamp(min=renorm_floor) + renorm_eps)
    return (weights if scaling == 1.0 else weights * scaling), ids


def keep_groups(scores: torch.Tensor, group_scores: torch.Tensor, keep: int, fill: float) -> torch.Tensor:
    """`scores` [T, E] with the experts outside the `keep` best groups set to `fill`."""
    tokens, groups = group_scores.shape
    chosen = torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    mask = mask.unsqueeze(-1).expand(tokens, groups, scores.shape[1] // groups).reshape(tokens, -1)
    return scores.masked_fill(~mask, fill)


ExpertLinear = Callable[[torch.Tensor, int, torch.Tensor | None], torch.Tensor]  # (rows, expert, bias) -> out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def run_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                up_proj: ExpertLinear, down_proj: ExpertLinear, b13: torch.Tensor | None,
                b2: torch.Tensor | None, activation: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """The routing-weighted sum of each token's experts, whatever holds their weights:
    `up_proj(rows, expert, bias)` and `down_proj(...)` apply one expert's projections.

    The T*k (token, expert) pairs are sorted by expert so each expert runs its two
    projections over all of its rows at once; the loop is over experts that got rows,
    never over tokens, and holds nothing but the projections: the rows are gathered, the
    activation applied and the weighted sum taken once for all experts (a decode step's
    8 experts of 48 layers made ~3000 small torch calls a token otherwise)."""
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)          # pair indices grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // top_k                             # pair -> its token row
    spans, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            spans.append((expert, start, start + count))
            start += count
    if not spans:
        return torch.zeros_like(x)
    rows = x[token_of]                                    # each pair's input, grouped by expert
    gate_up = _joined([up_proj(rows[a:b], e, None if b13 is None else b13[e]) for e, a, b in spans])
    hidden = (activation or swiglu)(gate_up)
    down = _joined([down_proj(hidden[a:b], e, None if b2 is None else b2[e]) for e, a, b in spans])
    # the routing weights in the model dtype (transformers' Qwen3-MoE casts them so too; a
    # float32 product of bf16 rows cost a 512-token prefill more than its expert loop); one
    # index_add_ sums each token's experts in float32 and rounds once (transformers' loop
    # rounds after each expert)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, down.mul_(weights.reshape(-1)[order].to(down.dtype).unsqueeze(1)).to(x.dtype))
    return out


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def per_expert(linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
               name: str) -> Callable[..., torch.Tensor]:
    """A moe_experts implementation (grouped_experts_ref's signature) that runs each
    expert's projections through `linear`, a `linear` builder, on the expert's slice of
    stacks laid out by that builder's preparation (`stacked`)."""
    def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        return run_grouped(x, weights, ids, w13.shape[0], lambda rows, e, bias: linear(rows, w13[e], bias),
                           lambda rows, e, bias: linear(rows, w2[e], bias), b13, b2, activation)
    experts.__name__ = experts.__qualname__ = name
    experts.__doc__ = f"grouped_experts_ref with each projection through {linear.__name__}."
    return experts


def stacked(prepare: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A `linear` builder's one-matrix preparation made a stack's: each expert of [E, rows,
    cols] prepared, into one new [E, ...] tensor (built expert by expert, so preparing costs
    one prepared stack beside the loaded one). The stack stays as loaded where the layout
    would not change, or would differ between experts (an expert the format does not take).
    `stored`: per expert, int4 parts as the checkpoint stored them, or None (int4 builders)."""
    def prepare_stack(stack: torch.Tensor, stored: list | None = None) -> torch.Tensor:
        if stack.dim() != 3 or not stack.is_floating_point():
            return stack  # prepared already
        out = None
        for e in range(stack.shape[0]):
            weight = stack[e]
            prepared = prepare(weight) if stored is None or stored[e] is None else prepare(weight, stored=stored[e])
            if out is None:
                if prepared is weight:
                    return stack
                out = torch.empty((stack.shape[0], *prepared.shape), dtype=prepared.dtype, device=prepared.device)
            elif prepared is weight or prepared.shape != out.shape[1:] or prepared.dtype != out.dtype:
                return stack
            out[e].copy_(prepared)
        return stack if out is None else out
    return prepare_stack


ExpertsImpl = Callable[..., torch.Tensor]  # a moe_experts implementation (grouped_experts_ref's signature)


def register_per_expert(linear_builder: str, name: str,
                        wrap: Callable[[ExpertsImpl], ExpertsImpl] | None = None) -> ExpertsImpl:
    """Register the moe_experts builder `name`: the `linear` builder named `linear_builder`
    run on each expert, under the same conditions (devices, dtypes, quantization, check,
    priority), with its weight preparation applied to each expert of a stack. `wrap` may put
    a faster path in front of that loop (the CPU's one-call layer: ops/cpu/moe_experts.py).
    Returns the implementation."""
    linear = next((b for b in builders("linear") if b.name == linear_builder), None)
    if linear is None:
        raise ValueError(f"no linear builder {linear_builder!r} is registered (import its module first)")
    impl = per_expert(linear.impl, name)
    impl = impl if wrap is None else wrap(impl)
    return register_op("moe_experts", name=name, priority=linear.priority, devices=linear.devices,
                       dtypes=linear.dtypes, quant=linear.quant, check=linear.check,
                       prepare=None if linear.prepare is None else stacked(linear.prepare))(impl)


@register_op("moe_experts", name="torch_grouped_experts", priority=0)
def grouped_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor, b13: torch.Tensor | None = None,
                        b2: torch.Tensor | None = None,
                        activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights, ids [T, k] -> [T, H]. Optional
    biases b13 [E, 2I], b2 [E, H]; `activation` maps [rows, 2I] (gate then up) to [rows, I]
    (None: SwiGLU)."""
    return run_grouped(x, weights, ids, w13.shape[0], lambda rows, e, bias: F.linear(rows, w13[e], bias),
                       lambda rows, e, bias: F.linear(rows, w2[e], bias), b13, b2, activation)


def expert_quantization(target: OpTarget) -> str | None:
    """How expert stacks are stored under `target`: its --quantization where some moe_experts
    builder takes it there, else the model dtype (None)."""
    if target.quant is None:
        return None
    try:
        select_op(target.spec("moe_experts", quant=target.quant))
    except OpLookupError:
        return None
    return target.quant


class ExpertStacks(OpModule):
    """What holds `w13_weight` and `w2_weight` stacks [E, rows, cols] in the model dtype as
    they load; after loading, `prepare_weights` hands them to the layout the moe_experts
    builder for `quant` wants (int8 / int4 codes under --quantization, packed panels for the
    CPU kernels). Subclasses create the two parameters."""

    def __init__(self, target: OpTarget):
        super().__init__()
        self.quant = expert_quantization(target)  # how the stacks are stored (the moe_experts spec's quant)
        self._prepare_stack = target.prepare("moe_experts", quant=self.quant)
        # int4: per stack and expert, where its rows came from (as Linear's: a Q4 GGUF's stored
        # parts are prepared as they are); loaders that note nothing leave the stack quantized
        self._stored: dict[int, dict[int, StoredInt4]] | None = (
            {} if self.quant == "int4" and self._prepare_stack is not None else None)
        # a stack whose file keeps it wider (a K-quant mix's Q6_K ffn_down_exps) takes int8's
        # layout, which every int4 builder's linear runs through int8's (ops/linear_int4.py)
        self._prepare_wider = target.prepare("moe_experts", quant="int8") if self._stored is not None else None

    def take_int4_parts(self, *params: nn.Parameter) -> None:
        """Mark the stacks whose loader notes stored int4 parts (note_expert_rows)."""
        for param in params:
            param.takes_int4_parts = self._stored is not None

    def note_expert_rows(self, param: nn.Parameter, expert: int, start: int, tensor: torch.Tensor,
                         rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """Rows [start, start + rows[1]) of `expert` in stack `param` were loaded from
        `tensor`'s rows and cols (each (first, length))."""
        if self._stored is not None:
            per_expert = self._stored.setdefault(id(param), {})
            per_expert.setdefault(expert, StoredInt4(param.shape[1])).note(start, tensor, rows, cols)

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the moe_experts op takes them."""
        return self.w13_weight, self.w2_weight

    def prepare_weights(self) -> None:
        """After loading: the stacks in the builder's layout (once)."""
        self.w13_weight = self._prepared(self.w13_weight)
        self.w2_weight = self._prepared(self.w2_weight)
        self._stored = None

    def _prepared(self, param: nn.Parameter) -> nn.Parameter:
        noted = (self._stored or {}).get(id(param), {})
        if self._prepare_wider is not None and any(rows.wider for rows in noted.values()):
            return prepared_param(param, self._prepare_wider)
        stored = [noted[e].parts() if e in noted else None for e in range(param.shape[0])]
        if not any(part is not None for part in stored):
            return prepared_param(param, self._prepare_stack)
        return prepared_param(param, lambda stack: self._prepare_stack(stack, stored=stored))


ExpertShard = tuple[int, int]  # (expert index, 0 = gate or down / 1 = up)


def copy_gate_up(dst: torch.Tensor, tensor: torch.Tensor, full: int, span: Span, what: str) -> None:
    """Dim 1 of `tensor` holds an expert stack's gate rows, then its up rows (2 * full of
    them): this rank's span of each half into `dst` (2 * span.size rows)."""
    local = span.size
    for half in (0, 1):
        copy_checked(dst.narrow(1, half * local, local), narrow(tensor, 1, half * full + span.start, local), what)


# a whole stack's gate or up half, stored apart (llama.cpp's ffn_gate_exps / ffn_up_exps)
GATE, UP = "gate", "up"


def copy_half(dst: torch.Tensor, tensor: torch.Tensor, half: str, full: int, span: Span, what: str) -> None:
    """Dim 1 of `tensor` holds the `half` (GATE or UP) of an expert stack (full rows): this
    rank's span into that half of `dst` (2 * span.size rows)."""
    if tensor.shape[1] != full:
        raise ValueError(f"{what}: the {half} half has {tensor.shape[1]} rows, the model {full}")
    local = span.size
    copy_checked(dst.narrow(1, (half == UP) * local, local), narrow(tensor, 1, span.start, local), what)


class StackedExperts(ExpertStacks):
    """Under tensor parallelism each rank holds a span of every expert's intermediate
    dimension (its gate and up rows, the matching down columns); outputs are summed."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, target: OpTarget,
                 bias: bool = False):
        super().__init__(target)
        self.full_intermediate = intermediate_size
        self.span = even_span(intermediate_size, target.tp_rank, target.tp_size)
        self.intermediate_size = intermediate_size = self.span.size  # this rank's
        self.w13_weight = make_param((num_experts, 2 * intermediate_size, hidden_size), target.dtype,
                                     target.device, loader=self._load,
                                     shard_ids=tuple((e, h) for e in range(num_experts) for h in (0, 1)))
        self.w2_weight = make_param((num_experts, hidden_size, intermediate_size), target.dtype,
                                    target.device, loader=self._load,
                                    shard_ids=tuple((e, 0) for e in range(num_experts)))
        self.take_int4_parts(self.w13_weight, self.w2_weight)
        self.w13_bias = self.w2_bias = None
        if bias:  # stacked as the weights are: [E, 2I] this rank's gate then up entries, [E, H]
            self.w13_bias = make_param((num_experts, 2 * intermediate_size), target.dtype, target.device,
                                       loader=self._load_bias, shard_ids=(GATE, UP))
            self.w2_bias = make_param((num_experts, hidden_size), target.dtype, target.device)

    def _load_bias(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        """The stacked gate-then-up bias [E, 2I] (or one half, [E, I]): this rank's span of each half."""
        if shard_id in (GATE, UP):
            with torch.no_grad():
                copy_half(param.data, tensor, shard_id, self.full_intermediate, self.span, "stacked expert bias")
            return
        expected = (param.shape[0], 2 * self.full_intermediate)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"stacked expert bias: checkpoint shape {tuple(tensor.shape)} != model shape {expected}")
        with torch.no_grad():
            copy_gate_up(param.data, tensor, self.full_intermediate, self.span, "stacked expert bias")

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        with torch.no_grad():
            full, span, local = self.full_intermediate, self.span, self.intermediate_size
            if shard_id is None:  # a checkpoint that already stores the stacked tensor
                num_experts, hidden = self.w2_weight.shape[:2]
                expected = ((num_experts, 2 * full, hidden) if param is self.w13_weight
                            else (num_experts, hidden, full))
                if tuple(tensor.shape) != expected and tuple(tensor.shape) == (expected[0], expected[2], expected[1]):
                    # stored as x @ W ([E, H, 2I], [E, I, H]: Qwen3-VL-MoE's files), as
                    # transformers reads them when the shape says so
                    tensor = materialize(tensor).transpose(1, 2)
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"stacked experts: checkpoint shape {tuple(tensor.shape)} != "
                                     f"model shape {expected}")
                if param is self.w13_weight:  # [E, 2I, H]: this rank's gate rows, then up rows
                    copy_gate_up(param.data, tensor, full, span, "stacked experts")
                else:                         # [E, H, I]
                    copy_checked(param.data, narrow(tensor, 2, span.start, local), "stacked experts")
                return
            expert, half = shard_id
            if not 0 <= expert < param.shape[0]:
                raise KeyError(f"expert {expert} out of range; this layer has {param.shape[0]} experts")
            dst = param.data[expert]
            hidden = dst.shape[0] if param is self.w2_weight else dst.shape[1]
            expected = (full, hidden) if param is self.w13_weight else (hidden, full)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"expert {expert} shard {half}: checkpoint shape "
                                 f"{tuple(tensor.shape)} != model shape {expected}")
            if param is self.w13_weight:  # checkpoint [I, H]: this rank's rows of it
                copy_checked(dst.narrow(0, half * local, local), narrow(tensor, 0, span.start, local),
                             f"expert {expert} shard {half}")
                self.note_expert_rows(param, expert, half * local, tensor, (span.start, local), (0, hidden))
            else:                         # down [H, I]: this rank's columns
                copy_checked(dst, narrow(tensor, 1, span.start, local), f"expert {expert} shard {half}")
                self.note_expert_rows(param, expert, 0, tensor, (0, hidden), (span.start, local))


class SparseMoE(OpModule):
    """Router (`gate`, a linear layer, with a bias where `bias`) + stacked experts (with
    biases where `bias`). `activation`: what the experts apply to their gate and up rows
    (None: SwiGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, target: OpTarget, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 experts_cls: type[nn.Module] = StackedExperts):
        """`experts_cls`: what holds the stacks (gpt-oss's reads its checkpoint's layout;
        packed MXFP4 stacks: ops/moe_mxfp4.py)."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, target, bias=bias)  # replicated: every rank routes
        self.experts = experts_cls(hidden_size, intermediate_size, num_experts, target, bias=bias)
        self.tp_size = target.tp_size
        self.activation = activation
        # the down projections' bias is added once, on rank 0, before the ranks' sum
        self.add_down_bias = target.tp_rank == 0
        self._route = target.op("moe_routing")
        self._experts = target.op("moe_experts", quant=self.experts.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self._route(self.gate(x), self.top_k, self.renormalize)
        experts = self.experts
        w13, w2 = experts.stacks()
        out = self._experts(x, w13, w2, weights, ids, experts.w13_bias,
                            experts.w2_bias if self.add_down_bias else None, self.activation)
        return all_reduce(out, self.tp_size)  # each rank computed its slice of every expert




# checkpoint projection name -> (stacked parameter, half)
MIXTRAL_EXPERT_NAMES = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", 0)}
HF_EXPERT_NAMES = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                   "down_proj": ("w2_weight", 0)}
_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")
# transformers' own fused layout (its in-memory modules): [E, 2I, H] gate-then-up, [E, H, I]
_FUSED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
# (".weight" as GGUF names carry it: llama.cpp's --fuse-gate-up-exps stores gate_up so too)
_FUSED_RE = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")


def expert_weight_target(name: str, names: dict[str, tuple[str, int]]
                         ) -> tuple[str, ExpertShard | None] | None:
    """A checkpoint name of one expert's projection -> (our parameter, (expert, half)); an
    already stacked tensor -> (parameter, None); anything else -> None."""
    match = _PER_EXPERT.match(name)
    if match and match.group(3) in names:
        prefix, expert, proj = match.groups()
        param, half = names[proj]
        return f"{prefix}.experts.{param}", (int(expert), half)
    match = _FUSED_RE.match(name)
    if match:
        return f"{match.group(1)}.experts.{_FUSED[match.group(2)]}", None
    return None
