"""Shared building blocks of every model family; each calls kernels/ through
the backend it is given, so a family file only composes them.

    norm.py          RMSNorm (fused residual add)
    linear.py        Linear over the backend's (packed) weights; all-reduce helper
    rotary.py        rotary position embedding tables
    attention.py     paged attention: q/k/v projection, RoPE, KV store, decode + prefill
    embedding.py     vocabulary-parallel embedding and the LM head's logits
    activation.py    the gated MLP (SiLU(gate) * up)
    moe.py           mixture-of-experts block: router + fused experts (Mixtral, Qwen3-MoE)
    quantization.py  int4 linear layers (GGUF Q4_1 weights)
    fused_layer.py   the layer loop: a whole Llama layer in one compiled call where it can
"""
