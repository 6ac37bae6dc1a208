"""The served model families, each a small description of how it departs from Llama.

The one forward (engine/model.py; each layer's in engine/decoder_layer.py) reads a
:class:`Family` for the choices that are fixed by the architecture (biases, extra norms,
activation, embedding scale, where the sliding windows fall, the checkpoint's weight names); the numbers a
checkpoint chooses (window size, soft-caps, attention scale) are read into
``ModelConfig``. Serving another family means adding an entry to ``FAMILIES``
when the forward already has every piece it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# HF parameter suffix of a decoder layer -> (our parameter, which columns of the fused weight).
# Projections are stored transposed, [in, out] (see engine/decoder_layer.py); biases and norms are 1-D.
LLAMA_WEIGHTS: dict[str, tuple[str, str | None]] = {
    "input_layernorm.weight": ("input_norm", None),
    "self_attn.q_proj.weight": ("qkv", "q"),
    "self_attn.k_proj.weight": ("qkv", "k"),
    "self_attn.v_proj.weight": ("qkv", "v"),
    "self_attn.o_proj.weight": ("o", None),
    "post_attention_layernorm.weight": ("post_norm", None),
    "mlp.gate_proj.weight": ("gate_up", "gate"),
    "mlp.up_proj.weight": ("gate_up", "up"),
    "mlp.down_proj.weight": ("down", None),
}

QKV_BIAS_WEIGHTS = {f"self_attn.{p}_proj.bias": ("qkv_bias", p) for p in "qkv"}
QK_NORM_WEIGHTS = {"self_attn.q_norm.weight": ("q_norm", None), "self_attn.k_norm.weight": ("k_norm", None)}
LLAMA_QKV_BIAS_WEIGHTS = {**LLAMA_WEIGHTS, **QKV_BIAS_WEIGHTS}
# Gemma's sandwich: its post_attention_layernorm is the attention output's norm, not the MLP's input norm.
GEMMA_WEIGHTS = {
    **LLAMA_WEIGHTS,
    "post_attention_layernorm.weight": ("attn_out_norm", None),
    "pre_feedforward_layernorm.weight": ("post_norm", None),
    "post_feedforward_layernorm.weight": ("mlp_out_norm", None),
}

# OLMo 2 and 3 (and EXAONE 4): no norm before attention or MLP, one after each, and q/k norms.
OLMO_WEIGHTS = {
    **{k: v for k, v in LLAMA_WEIGHTS.items() if "layernorm" not in k},
    **QK_NORM_WEIGHTS,
    "post_attention_layernorm.weight": ("attn_out_norm", None),
    "post_feedforward_layernorm.weight": ("mlp_out_norm", None),
}

# Our layer parameters that are RMSNorm weights (a family's norm offset applies to them).
NORMS = frozenset({"input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm"})
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Family:
    name: str
    weights: dict[str, tuple[str, str | None]] = field(default_factory=lambda: dict(LLAMA_WEIGHTS))
    # q, k and v carry biases (added to the fused qkv output).
    qkv_bias: bool = False
    # The config says so with attention_bias (Seed-OSS), which must then be true.
    bias_flag: bool = False
    # Each head of q and k goes through its own RMSNorm before RoPE.
    qk_norm: bool = False
    # Instead, one RMSNorm spans all of q and one all of k (OLMo 2).
    qk_norm_full: bool = False
    # Attention and MLP read the residual stream through a norm; without (OLMo 2) they read it as
    # it is, and only their outputs are normed (sandwich_norms).
    pre_norms: bool = True
    # RMSNorm scales by (offset + w); folded into the weights at load, so the forward is unchanged.
    norm_offset: float = 0.0
    # Embeddings are multiplied by sqrt(hidden_size).
    embed_scale: bool = False
    # The attention and MLP outputs are normed before they join the residual stream.
    sandwich_norms: bool = False
    # The config key naming the MLP activation.
    activation_key: str = "hidden_act"
    # Which layers use ``sliding_window``: "all", "layer_types" (the config's list, or for older
    # configs Qwen's rule, layers from ``max_window_layers`` on, where window_flag is set, else every
    # layer), "alternate" (even layers).
    window_layers: str = "all"
    # Whether ``use_sliding_window`` must be true for the window to apply (Qwen).
    window_flag: bool = False
    # HF's model rotates only the first ``partial_rotary_factor`` of each head (Phi-3's does).
    partial_rotary: bool = False
    # LongRoPE scaling is served: HF's model recomputes a sequence that outgrows the original context
    # (Phi-3's ``prepare_inputs_for_generation``), the rule engine/rope.py follows. Where a model keeps
    # the keys cached under the short factors instead, serving it would need another rule.
    longrope: bool = False
    # Older names of rope types in this family's configs (Phi-3's "su" and "yarn" are LongRoPE).
    rope_aliases: dict[str, str] = field(default_factory=dict)
    # The sliding layers rotate with plain RoPE of their own base, the global ones with their own
    # (scaled) parameters: per layer type in transformers 5's configs (Gemma 3, OLMo 3).
    local_rope: bool = False
    # With a sliding window, the global layers take no RoPE (EXAONE 4's hybrid attention).
    global_nope: bool = False
    # For older configs of such a family: every global_every-th layer is global when no layer_types
    # are given, and the sliding layers' base without rope_local_base_freq (None: the global base).
    global_every: int = 6
    local_theta: float | None = 10000.0
    # Some layers take no position embedding at all (SmolLM3's NoPE layers).
    nope_layers: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 1-3.x"),
    "mistral": Family("Mistral"),
    # Mistral's layer with windows on the layers layer_types names (all of them without).
    "ministral": Family("Ministral", window_layers="layer_types"),
    # Llama with scalar multipliers on embeddings, residual branches, attention scores and logits (ModelConfig).
    "granite": Family("Granite 3.x"),
    # Llama with every few layers free of RoPE; windows, when on, as Qwen's.
    "smollm3": Family("SmolLM3", window_layers="layer_types", window_flag=True, nope_layers=True),
    "qwen2": Family("Qwen2 / Qwen2.5", weights=LLAMA_QKV_BIAS_WEIGHTS, qkv_bias=True,
                    window_layers="layer_types", window_flag=True),
    # Llama's layer with Qwen2's q/k/v biases.
    "seed_oss": Family("Seed-OSS", weights=LLAMA_QKV_BIAS_WEIGHTS, qkv_bias=True, bias_flag=True),
    "qwen3": Family("Qwen3", weights={**LLAMA_WEIGHTS, **QK_NORM_WEIGHTS}, qk_norm=True,
                    window_layers="layer_types", window_flag=True),
    "phi3": Family(
        "Phi-3",
        weights={
            "input_layernorm.weight": ("input_norm", None),
            "self_attn.qkv_proj.weight": ("qkv", None),
            "self_attn.o_proj.weight": ("o", None),
            "post_attention_layernorm.weight": ("post_norm", None),
            "mlp.gate_up_proj.weight": ("gate_up", None),
            "mlp.down_proj.weight": ("down", None),
        },
        partial_rotary=True, longrope=True, rope_aliases={"su": "longrope", "yarn": "longrope"},
    ),
    "gemma2": Family(
        "Gemma 2",
        weights=GEMMA_WEIGHTS,
        norm_offset=1.0, embed_scale=True, sandwich_norms=True, activation_key="hidden_activation",
        window_layers="alternate",
    ),
    # Norms after attention and MLP only, none before; q and k each normed whole.
    "olmo2": Family(
        "OLMo 2",
        weights=OLMO_WEIGHTS,
        qk_norm_full=True, pre_norms=False, sandwich_norms=True,
    ),
    # OLMo 2's layer with sliding windows on three layers of four, the others global (YaRN there).
    "olmo3": Family(
        "OLMo 3",
        weights=OLMO_WEIGHTS,
        qk_norm_full=True, pre_norms=False, sandwich_norms=True, window_layers="layer_types", local_rope=True,
        global_every=4, local_theta=None,
    ),
    # OLMo 2's norms but per-head q/k norms; windows on the sliding layers, no RoPE on the global ones.
    "exaone4": Family(
        "EXAONE 4", weights=OLMO_WEIGHTS, qk_norm=True, pre_norms=False, sandwich_norms=True,
        window_layers="layer_types", global_nope=True, global_every=4,
    ),
    # Gemma 2's layer, with q/k norms instead of soft-caps, a global layer every few, each kind its own RoPE.
    "gemma3_text": Family(
        "Gemma 3 (text)",
        weights={**GEMMA_WEIGHTS, **QK_NORM_WEIGHTS},
        qk_norm=True, norm_offset=1.0, embed_scale=True, sandwich_norms=True, activation_key="hidden_activation",
        window_layers="layer_types", local_rope=True,
    ),
}


def family_for(model_type: str, architectures: list[str] | None = None) -> Family:
    """The family serving ``model_type``; anything else is refused naming it and what is served."""
    family = FAMILIES.get(model_type)
    if family is None:
        archs = ", ".join(architectures or [model_type or "unknown"])
        served = ", ".join(f"{k} ({f.name})" for k, f in FAMILIES.items())
        raise ValueError(f"model family {model_type!r} ({archs}) is not served; served model_types: {served}")
    return family
