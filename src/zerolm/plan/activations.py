"""Activation bytes: what one device keeps for the backward pass of one micro-batch.

Two models. `activation_bytes` is the paper's minimal set for the ZeRO stage table, after Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1) without dropout,
for a micro-batch of b sequences of s tokens, width h, a heads, L layers, e bytes per compute element
(bf16: 2) and tensor parallelism t. Per layer: the two LayerNorm inputs and outputs (4·sbh, replicated
over tp), q, k, v (3·sbh/t), the attention output (sbh/t), the MLP's GELU input and output (8·sbh/t),
and the softmax probabilities a·s²·b/t (none with flash attention, which keeps a float32 log-sum-exp per
row). With full remat a layer keeps only its input (sbh), and one layer at a time is rebuilt during the
backward pass. Beyond the layers: the final LayerNorm's input and output, and the output layer: zerolm's
chunked loss keeps the float32 gradient of the embedding (V·h) and two float32 chunks of logits
(chunk·V); unchunked, the float32 logits and their gradient (2·b·s·V).

`step_activation_bytes` is what zerolm's own gradient program allocates, as the TPU compiler's buffer
assignment counts it (the planner's step peak, checked against `zerolm compile`).
"""

from __future__ import annotations

from zerolm.model.attention import PALLAS_LANES
from zerolm.parallel.auto import Where, scan_layers
from zerolm.plan.spec import Model

# Elements of the compute dtype per token and model width: what a block keeps for its backward pass
# without remat (every matmul's output and the attention's, zerolm.model.decoder.REMAT_POLICIES["none"]), and what
# one block's rebuild and backward pass hold under full remat. Read from the compilers' figures for
# zerolm's step (125m-1_3b on v3-32, v4-32, v5e-64, v5p-64 with libtpu and on h100-8 with XLA's GPU
# compiler, micro-batch 1-32; BENCHMARKS.md "The planner's step peak against the compilers'"): with the
# layers in a scan, KEPT_PER_LAYER over two or more micro-steps, plus LAYER_WEIGHTS_KEPT·h² per layer
# whatever the micro-batch (the compiled step keeps per-layer copies of the block's 12·h² weights in other
# layouts: the kept bytes grew with the width at a fixed micro-batch); KEPT_PER_LAYER_ONE_MICRO_STEP at one
# micro-step per step, where XLA inlines the accumulation loop; unrolled (a GPU without remat),
# KEPT_PER_LAYER_UNROLLED, about the saved set (q, k, v, the attention's output, the block's input, the
# MLP's 4h pre-activation and the two projections: 11 elements, 9 counted, the compiler reusing some),
# and KEPT_PER_LAYER_UNROLLED_ONE_MICRO_STEP at one micro-step. Full remat rebuilds one layer at a time:
# REBUILT_LAYER in a scan, REBUILT_LAYER_UNROLLED unrolled. Each count is the one that keeps the largest
# under-count of a step that fits within plan.SAFETY_MARGIN with the least mean error over the 120
# compiles (largest under-count 14.5%, mean error 9%; over-counts, which only make advice cautious, up to
# 76%, on a GPU with full remat).
KEPT_PER_LAYER = 14
KEPT_PER_LAYER_ONE_MICRO_STEP = 12
KEPT_PER_LAYER_UNROLLED = 9
KEPT_PER_LAYER_UNROLLED_ONE_MICRO_STEP = 12
LAYER_WEIGHTS_KEPT = 12
REBUILT_LAYER = 64
REBUILT_LAYER_UNROLLED = 8


def activation_bytes(m: Model, micro: int, tp: int, remat: str, flash: bool) -> int:
    """Bytes one device keeps for the backward pass of one micro-batch (see the module docstring)."""
    s, b, h, a, e = m.seq_len, micro, m.d_model, m.n_head, m.act_bytes
    sbh = s * b * h
    scores = 4 * a * s * b // tp if flash else a * s * s * b * e // tp
    layer = 4 * sbh * e + round(12 * m.layer_outputs_ratio * sbh * e) // tp + scores
    layers = m.n_layer * layer if remat == "none" else m.n_layer * sbh * e + layer
    tokens = b * s
    if m.loss_chunk and m.loss_chunk < tokens:
        loss = m.vocab * h * 4 + 2 * m.loss_chunk * m.vocab * 4
    else:
        loss = 2 * tokens * m.vocab * 4
    return layers + 2 * sbh * e + loss


def step_activation_bytes(m: Model, micro: int, attention: str, accum_steps: int, where: Where) -> int:
    """What zerolm's gradient program allocates for one micro-batch besides the model states, with the
    attention zerolm runs (`attention`), as counted in the TPU compiler's buffer assignment of zerolm's
    step (125m, v3; docs/performance-notes.md):

    - per layer, kept for the backward pass without remat, KEPT_PER_LAYER·s·b·h elements of the
      compute dtype (KEPT_PER_LAYER_ONE_MICRO_STEP with one micro-step per step, `accum_steps` 1;
      KEPT_PER_LAYER_UNROLLED with the layers unrolled, `scanned` False): every matmul's output and
      the attention's (the LayerNorms and the GELU are rebuilt in the backward pass);
      XLA's attention adds its T×T probabilities and float32 scores, Pallas's its softmax statistics
      (2·a·s·b·128 float32: the kernel pads a row's max and sum to the TPU's 128 lanes), and once
      a relayouted copy of the stacked c_attn kernel (L·3h²); with model.document_mask, the segment ids
      (int32 per token; XLA's attention also its T×T mask, a byte per pair; cuDNN's, once, the mask as
      a T×T additive bias of the compute dtype);
    - with full remat, each layer's input, plus REBUILT_LAYER·s·b·h for the one layer being rebuilt
      and run backward;
    - the loss: the output layer's float32 gradient as it is summed and the embedding's (2·V·h·4),
      and a chunk's float32 logits with their gradient in the compute dtype (the micro-batch's, if
      smaller; without chunking, loss_chunk 0, autodiff keeps three float32 copies)."""
    scanned = scan_layers(m.scan_layers, where, m.remat)  # the layer loop zerolm compiles there
    b, t, platform = micro, where.tp, where.platform
    s, h, a, e, L = m.seq_len, m.d_model, m.n_head, m.act_bytes, m.n_layer
    sbh = s * b * h
    # XLA's: the T×T probabilities and float32 scores. Pallas's kernel keeps its softmax statistics
    # (running max and sum) as two float32 rows of 128 lanes per query; the blockwise one a float32 each.
    lane_row = a * s * b * PALLAS_LANES * 4 // t
    scores = a * s * s * b * (e + 4) // t if attention == "xla" else 2 * lane_row if attention == "pallas" else 0
    # Around the Pallas kernels XLA adds, once, a copy of the stacked c_attn kernel in the layout the
    # kernels' (B, H, T, K) operands want, hoisted out of the loops (the buffer assignment of 1_3b on
    # v5p-64: docs/performance-notes.md).
    pallas_once = L * h * 3 * h * e // t if attention == "pallas" else 0
    # model.document_mask: each layer keeps the int32 segment ids for its attention's backward pass, and
    # XLA's attention its T×T mask of them (a byte per pair); the scores are computed as before. cuDNN's
    # takes the mask as one additive bias of the compute dtype, built once and shared by the layers (on an
    # H100, 125m at micro-batch 16 peaked 0.12 GiB higher with the mask: b·s²·2 bytes is 0.125 GiB).
    mask_once = 0
    if m.document_mask:
        scores += s * b * 4 + (s * s * b if attention == "xla" else 0)
        mask_once = s * s * b * e if attention == "cudnn" else 0
    if m.remat == "none":
        one = accum_steps == 1
        kept = ((KEPT_PER_LAYER_UNROLLED_ONE_MICRO_STEP if one else KEPT_PER_LAYER_UNROLLED) if not scanned else
                KEPT_PER_LAYER_ONE_MICRO_STEP if one else KEPT_PER_LAYER)
        weights = round(LAYER_WEIGHTS_KEPT * m.layer_weights_ratio * h * h * e) // t if scanned and accum_steps > 1 else 0
        layers = L * (round(kept * m.layer_outputs_ratio * sbh * e) // t + weights + scores) + pallas_once + mask_once
    else:
        rebuilt = REBUILT_LAYER if scanned else REBUILT_LAYER_UNROLLED
        layers = (L * sbh * e + round(rebuilt * m.layer_outputs_ratio * sbh * e) // t + scores + pallas_once
                  + mask_once)
    tokens = b * s
    # The fused loss's chunk: its float32 logits, and the gradient of them in the compute dtype where the
    # compiler writes it out for the two matmuls that read it (a GPU's cuBLAS does; the TPU compiler fuses
    # its one elementwise pass into them).
    gradient = 0 if platform == "tpu" else e
    logits = min(tokens, m.loss_chunk) * m.vocab * (4 + gradient) if m.loss_chunk else 3 * tokens * m.vocab * 4
    return layers + 2 * m.vocab * h * 4 + logits
