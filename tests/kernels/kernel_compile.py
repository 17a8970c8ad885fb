"""Compile the Triton kernels for a CUDA target without a GPU.

The interpreter accepts some code the real compiler rejects (loop-carried
type changes, unsupported constexpr use, dot shapes), so the CPU suite also
compiles a few representative configurations down to a cubin for sm_90
(ptxas ships inside the triton wheel; no driver needed).  Must be imported
before TRITON_INTERPRET is set: interpreted @jit functions cannot be compiled.
"""

from __future__ import annotations

import torch

TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _compile(jit_fn, pointer_types: dict, constants: dict, capability: int, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in jit_fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = pointer_types.get(name, "i32")  # strides, lengths
    source = ASTSource(jit_fn, signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def compile_all(dtype: torch.dtype, head_dim: int, group: int, block_size: int, capability: int = 90) -> None:
    """Compile decode (plain, split), reduce, prefill and store for one config;
    decode and prefill also with both features (sliding window, soft cap) on,
    and prefill plain without CAUSAL (encoders)."""
    import triton

    from kernels import paged_decode as pd
    from kernels import paged_prefill as pp
    from kernels import store_kvcache_triton as sk

    t = "*" + TRITON_TYPES[dtype]
    attention = dict(q_ptr=t, k_cache_ptr=t, v_cache_ptr=t, out_ptr=t, table_ptr="*i32",
                     context_lens_ptr="*i32", cu_seqlens_ptr="*i32", part_out_ptr="*fp32",
                     part_m_ptr="*fp32", part_l_ptr="*fp32", qk_scale="fp32", soft_cap="fp32",
                     stride_block="i64")
    plain = dict(GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, UPCAST=False,
                 WINDOW=False, SOFT_CAP=False, ROW_ALIGN=1)
    for shared in (plain, dict(plain, WINDOW=True, SOFT_CAP=True)):
        for split in (False, True):
            _compile(pd._decode_kernel, attention,
                     dict(shared, SPLIT=split, **pd._decode_config(head_dim, group)), capability)
        prefill = pp._prefill_config(head_dim, group, dtype)
        stages = prefill.pop("num_stages")
        for causal in (True, False) if shared is plain else (True,):
            _compile(pp._prefill_kernel, attention, dict(shared, CAUSAL=causal, **prefill), capability,
                     num_stages=stages)
    dim_pad = triton.next_power_of_2(head_dim)
    _compile(pd._decode_reduce_kernel, attention, dict(HEAD_DIM=head_dim, DIM_PAD=dim_pad, PARTS_PAD=64),
             capability)
    store = dict(key_ptr=t, value_ptr=t, k_cache_ptr=t, v_cache_ptr=t, slot_ptr="*i64")
    _compile(sk._store_kvcache_kernel, store,
             dict(NUM_KV_HEADS=4, HEAD_DIM=head_dim, HEADS_PAD=4, DIM_PAD=dim_pad, UPCAST=False), capability)
