"""A model as the simulator sees it: its units, each with parameters, FLOPs and activation bytes.

Units follow the engine's wrapping: one per transformer block (the encoder's blocks, then the
decoder's, in the order forward runs them) plus the root unit, which holds everything outside the
blocks (embeddings, final norms, the output head) and stays gathered for the whole step.

FLOPs count matrix multiplications only, 2 m k n each (Megatron-LM's convention, which the T5
document's appendix follows). Per token of a block's input, forward:

    projections   2 x (q, k, v, o weights) = 2 (2 h w + 2 h w_kv)
    attention     scores and weighted values: 4 s w  (s: keys attended to; causal masks counted full)
    MLP           2 h f x (3 if gated else 2)
    cross-attn    (decoder of an encoder-decoder) q, o on decoder tokens: 4 h w; k, v on the encoder
                  tokens: 4 h w_kv per encoder token; scores: 4 s_enc w
    head          2 h V per (decoder) token, in the root unit

where ``w`` is the queries' width (heads x head_dim: h, unless the model's heads are wider, as
Qwen3's and Gemma's are) and ``w_kv`` that of the keys or the values (kv_heads x head_dim).

For a GPT this is the familiar 2 x (block parameters) + 4 s h per layer and token, so forward plus
backward (2 x forward) gives 6 x parameters + 12 x layers x hidden x seq per token; for T5 v1.1
(gated MLP with f = 2.5 h) it gives the document's 23 B s h^2 + 4 B s^2 h per encoder block and
31 B s h^2 + 8 B s^2 h per decoder block.

Activations are the bytes a unit's forward saves for backward, per sequence, in the compute dtype
(``c`` bytes per element), following the accounting of Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022), without dropout masks. Per token:

    norms          2 c h (the two norms' inputs; a third for the cross-attention)
    attention      c h (q, k, v projections' input) + c (w + 2 w_kv) (q, k, v) + c w (output
                   projection's input); eager attention adds c a s (the softmax output, a heads)
    MLP            c h (input) + 2 c f (activation's input and output), or 3 c f when gated
                   (gate, up and their product)
    cross-attn     2 c h + 2 c w per decoder token, 2 c w_kv per encoder token (k, v), plus c a s_enc eager

For a GPT with f = 4 h and 16-bit activations that is 32 h bytes per token and layer: Korthikanti's
34 h less the dropout masks. A unit's ``boundary`` is its input, all that activation checkpointing
keeps. The root keeps the head's input (and an encoder-decoder's encoder output, which every
cross-attention reads); the loss keeps fp32 log-probabilities, whose gradient doubles them.

Kernels, for the compute model (``shardwire.sim.compute``) to time: each unit's forward as its
matrix multiplies (rows per sequence, inner and output sizes: the shapes set how near peak they
run), its attention (queries, keys, heads, head size, causal or not) and the bytes per sequence its
memory-bound kernels move, as eager PyTorch runs them and as torch.compile fuses them. Per token of
a block, in elements of ``c`` bytes:

    eager      norms 2 x 2 h (LayerNorm: one kernel reads and writes) or 2 x 18 h (RMSNorm as eager
               PyTorch runs it: cast to fp32, square, mean, scale, cast back, weight, each pass
               reading and writing fp32 or c); residual adds 2 x 3 h; the MLP's activation 2 f
               (GELU: read, write) or 5 f when gated (SiLU, then its product with the up
               projection); rotary embeddings 10 (w + w_kv) (q and k cast to fp32, rotated as
               complex numbers, cast back) where positions are not learned; attention's output
               made contiguous 2 w
    fused      each residual add with the next norm 4 h (read both, write the sum and the normed);
               the activation 2 f or 3 f; rotary embeddings 2 (w + w_kv); the output copy 2 w

The root moves the loss's fp32 log-probabilities: 14 V bytes per token in forward (the logits cast
to fp32, log-softmax's two reads and a write), eager or not.
"""

from __future__ import annotations

import dataclasses

from shardwire.sim.specs import ModelSpec, SpecError

# How far a model's stated parameter count may be from its architecture's (biases and rounding).
PARAMS_TOLERANCE = 0.05
ROOT = "root"
# Bytes per token and vocabulary entry the loss moves in forward (see above).
LOSS_BYTES_PER_LOGIT = 14
# Elements of c bytes an eager norm and eager rotary embeddings move per element (see above).
EAGER_NORM = {"layernorm": 2, "rmsnorm": 18}
EAGER_ROTARY = 10


@dataclasses.dataclass(frozen=True)
class Matmul:
    """``count`` matrix multiplies of a (rows x k) input by a (k x n) weight, per sequence; ``linear``:
    a layer's weight (fp8 training runs these in fp8), not attention's scores or the head."""

    rows: int
    k: int
    n: int
    count: int = 1
    linear: bool = True

    @property
    def flops(self) -> float:
        return 2 * self.rows * self.k * self.n * self.count


@dataclasses.dataclass(frozen=True)
class Attention:
    """Scores and weighted values of ``heads`` heads of ``head_dim``, ``queries`` x ``keys`` per
    sequence; ``causal``: each query attends to the keys before it (a fused kernel skips the rest);
    ``eager``: the scores are materialized, as two batched matrix multiplies and a softmax."""

    queries: int
    keys: int
    heads: int
    head_dim: int
    causal: bool
    eager: bool

    @property
    def flops(self) -> float:
        """Model FLOPs (the causal mask not discounted, as MFU counts them)."""
        return 4 * self.queries * self.keys * self.heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """One unit: its parameters, and per sequence its forward FLOPs, activation bytes and kernels."""

    name: str
    params: int
    forward_flops: float
    activation_bytes: float  # saved by forward for backward, without checkpointing
    boundary_bytes: float  # the unit's input: what checkpointing keeps
    matmuls: tuple[Matmul, ...] = ()
    attention: tuple[Attention, ...] = ()
    elementwise_bytes: float = 0.0  # moved by forward's memory-bound kernels, eager
    fused_bytes: float = 0.0  # the same, fused by torch.compile


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The root unit and the block units in forward order; sizes per sequence."""

    root: UnitCost
    units: tuple[UnitCost, ...]
    logits_bytes: float  # the loss's fp32 log-probabilities and their gradient

    @property
    def params(self) -> int:
        return self.root.params + sum(u.params for u in self.units)

    @property
    def forward_flops(self) -> float:
        return self.root.forward_flops + sum(u.forward_flops for u in self.units)

    @property
    def model_flops(self) -> float:
        """A training step's FLOPs per sequence: forward, and backward at twice forward (MFU's count)."""
        return 3 * self.forward_flops

    def hardware_flops(self, recomputed: float) -> float:
        """``model_flops`` plus the share ``recomputed`` of every block's forward that activation
        checkpointing runs again in backward (the root is not recomputed): HFU's count."""
        return self.model_flops + recomputed * sum(u.forward_flops for u in self.units)


def architecture(model: ModelSpec, compute_bytes: int) -> Architecture:
    """The units of ``model`` with activations counted at ``compute_bytes`` per element."""
    c = compute_bytes
    h, f, V = model.hidden, model.ffn_hidden, model.vocab
    head_dim = model.head_width
    w, w_kv = model.heads * head_dim, model.kv_heads * head_dim  # the widths of queries, and of keys or values
    attention_params = 2 * h * w + 2 * h * w_kv
    mlp_params = h * f * (3 if model.ffn_gated else 2)
    mlp_acts = c * h + c * f * (3 if model.ffn_gated else 2)
    eager = model.attention == "eager"
    rotary = 0 if model.learned_positions or model.kind != "decoder" else w + w_kv

    def attention_acts(keys: int) -> float:  # per query token, attending to ``keys`` tokens
        return c * h + c * (w + 2 * w_kv) + c * w + (c * model.heads * keys if eager else 0)

    def block_kernels(s: int, keys: int, causal: bool) -> dict:
        matmuls = (Matmul(s, h, w + 2 * w_kv), Matmul(s, w, h),
                   Matmul(s, h, f, count=2 if model.ffn_gated else 1), Matmul(s, f, h))
        attention = (Attention(s, keys, model.heads, head_dim, causal, eager),)
        activation = (5, 3) if model.ffn_gated else (2, 2)
        per_token = (2 * EAGER_NORM[model.norm] * h + 6 * h + activation[0] * f + EAGER_ROTARY * rotary + 2 * w,
                     2 * 4 * h + activation[1] * f + 2 * rotary + 2 * w)
        return dict(matmuls=matmuls, attention=attention, elementwise_bytes=s * c * per_token[0],
                    fused_bytes=s * c * per_token[1])

    def block(name: str, s: int, keys: int, causal: bool) -> UnitCost:
        params = attention_params + mlp_params + 2 * h
        flops = s * (2 * (attention_params + mlp_params) + 4 * keys * w)
        acts = s * (2 * c * h + attention_acts(keys) + mlp_acts)
        return UnitCost(name, params, flops, acts, s * c * h, **block_kernels(s, keys, causal))

    def cross_block(name: str, s: int, s_enc: int) -> UnitCost:
        base = block(name, s, s, causal=True)
        cross_params = 2 * h * w + 2 * h * w_kv
        cross_flops = s * (4 * h * w + 4 * s_enc * w) + s_enc * 4 * h * w_kv
        cross_acts = s * (2 * c * h + 2 * c * w + (c * model.heads * s_enc if eager else 0)) + s_enc * 2 * c * w_kv
        cross = (Matmul(s, h, w), Matmul(s, w, h), Matmul(s_enc, h, 2 * w_kv))
        # one more norm and residual add per decoder token, eager and fused
        norm = EAGER_NORM[model.norm] * h + 3 * h
        return dataclasses.replace(
            base, params=base.params + cross_params + h, forward_flops=base.forward_flops + cross_flops,
            activation_bytes=base.activation_bytes + cross_acts, matmuls=base.matmuls + cross,
            attention=base.attention + (Attention(s, s_enc, model.heads, head_dim, False, eager),),
            elementwise_bytes=base.elementwise_bytes + s * c * norm, fused_bytes=base.fused_bytes + s * c * 4 * h)

    embeddings = V * h + (0 if model.tied_embeddings else V * h)
    if model.kind == "decoder":
        s = model.seq_len
        units = tuple(block(f"block.{i}", s, s, causal=True) for i in range(model.layers))
        positions, norms, head_tokens = (model.positions or s) * h if model.learned_positions else 0, h, s
    else:
        s_enc, s_dec = model.seq_len, model.decoder_seq_len
        units = tuple(block(f"encoder.{i}", s_enc, s_enc, causal=False) for i in range(model.layers)) + tuple(
            cross_block(f"decoder.{i}", s_dec, s_enc) for i in range(model.decoder_layers)
        )
        positions = (s_enc + s_dec) * h if model.learned_positions else 0
        norms, head_tokens = 2 * h, s_dec
    kept = (head_tokens if model.kind == "decoder" else head_tokens + model.seq_len) * c * h
    loss = head_tokens * V * LOSS_BYTES_PER_LOGIT
    root = UnitCost(ROOT, embeddings + positions + norms, 2 * head_tokens * h * V, kept, 0.0,
                    matmuls=(Matmul(head_tokens, h, V, linear=False),), elementwise_bytes=loss, fused_bytes=loss)
    arch = Architecture(root, units, logits_bytes=head_tokens * V * 4 * 2)
    if model.params is not None and abs(arch.params / model.params - 1) > PARAMS_TOLERANCE:
        raise SpecError(
            f"model {model.name!r}: its sizes make {arch.params:,} parameters but params says {model.params:,}; "
            f"check layers, hidden, ffn_hidden, ffn_gated, kv_heads, vocab and tied_embeddings"
        )
    return arch
