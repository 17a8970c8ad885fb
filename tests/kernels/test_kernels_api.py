"""kernels/__init__.py: backend selection, support checks, lazy triton import."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import check_backend_support, get_backend
from kernels.reference import (paged_decode_attention_reference,
                               paged_prefill_attention_reference, store_kvcache_reference)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_accepts_supported_configs(block_size, head_dim, dtype, monkeypatch,
                                         triton_available):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets a CPU device pass
    assert check_backend_support("triton", block_size, head_dim, dtype, "cpu") is None
    # auto on CUDA selects the triton rules, and needs no interpreter there.
    assert check_backend_support("auto", block_size, head_dim, dtype, "cuda") is None
    # The config was accepted by going through every rule, down to the last one:
    # without triton the same config is refused, so the engine fails at start-up
    # rather than at its first CUDA call.
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    for backend, device in (("triton", "cpu"), ("auto", "cuda")):
        with pytest.raises(ValueError, match="needs the 'triton' package"):
            check_backend_support(backend, block_size, head_dim, dtype, device)


@pytest.mark.parametrize("block_size", [0, 3, 24, 512])
def test_triton_refuses_block_size(block_size, triton_available):
    with pytest.raises(ValueError, match=r"block_size must be a (power of two in \[1, 256\]|positive)"):
        check_backend_support("triton", block_size, 64, torch.float16, "cuda")


@pytest.mark.parametrize("head_dim", [32, 72, 100, 160, 512])
def test_triton_refuses_head_dim(head_dim, triton_available):
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 80, 96, 128, 256\)"):
        check_backend_support("triton", 16, head_dim, torch.float16, "cuda")


@pytest.mark.parametrize("backend", ["auto", "torch", "triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_every_backend_refuses_dtype(backend, dtype):
    with pytest.raises(ValueError, match="supported: float32, float16, bfloat16"):
        check_backend_support(backend, 16, 64, dtype, "cpu")


def test_triton_refuses_cpu_without_interpreter(monkeypatch, triton_available):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_backend_support("triton", 16, 64, torch.float32, "cpu")


def store_and_attend(backend, block_size, head_dim, dtype):
    """Two sequences through `backend`: the caches after the store, then decode and
    prefill attention over them. The first sequence spans two blocks, so block
    boundaries are crossed; head_dim and block_size are whatever the test picks."""
    generator = torch.Generator().manual_seed(0)
    lens = [block_size + 2, 3]
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    slots = torch.tensor([tables[s, p // block_size].item() * block_size + p % block_size
                          for s, length in enumerate(lens) for p in range(length)])
    k_cache, v_cache = torch.zeros(2, 4, block_size, 2, head_dim, dtype=dtype).unbind(0)
    key, value, query = (torch.randn(sum(lens), heads, head_dim, generator=generator).to(dtype)
                         for heads in (2, 2, 4))
    backend.store_kvcache(key, value, k_cache, v_cache, slots)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    cu_seqlens = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    prefill = backend.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens,
                                              context_lens, scale)
    last = cu_seqlens[1:] - 1  # each sequence's last token, as a decode query
    decode = backend.paged_decode_attention(query[last].contiguous(), k_cache, v_cache, tables,
                                            context_lens, scale)
    return k_cache, v_cache, prefill, decode


@pytest.mark.parametrize("block_size, head_dim, dtype, device", [
    (3, 72, torch.float32, "cpu"),
    (1000, 8, torch.bfloat16, torch.device("cpu")),
], ids=["odd-shape", "huge-block"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_torch_rules_on_cpu_take_any_shape(backend, block_size, head_dim, dtype, device):
    assert check_backend_support(backend, block_size, head_dim, dtype, device) is None
    # Accepted means the backend the engine then builds runs this shape, and
    # agrees with the reference on it.
    got = store_and_attend(get_backend(backend), block_size, head_dim, dtype)
    expected = store_and_attend(get_backend("torch"), block_size, head_dim, dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("k_cache", "v_cache", "prefill", "decode"), got, expected):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance,
                                   msg=lambda message, name=name: f"{name}: {message}")
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        check_backend_support(backend, 0, 64, torch.float32, "cpu")


def test_auto_on_cuda_uses_triton_rules(triton_available):
    with pytest.raises(ValueError, match="head_dim must be one of"):
        check_backend_support("auto", 16, 72, torch.float16, "cuda")


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="expected one of"):
        check_backend_support("cuda", 16, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="expected one of"):
        get_backend("flash")


def test_torch_backend_is_the_reference():
    backend = get_backend("torch")
    assert backend.name == "torch"
    assert backend.store_kvcache is store_kvcache_reference
    assert backend.paged_decode_attention is paged_decode_attention_reference
    assert backend.paged_prefill_attention is paged_prefill_attention_reference
    with pytest.raises(AttributeError):
        backend.name = "triton"  # frozen


def test_auto_backend_on_cpu_without_the_compiled_op_is_the_reference(monkeypatch):
    # With the compiled op (tests/kernels/test_kernels_cpu_compiled.py) auto is
    # close to the reference; turned off, float32 is the reference exactly.
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "off")
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 16).unbind(0)
    tables = torch.tensor([[3, 1], [5, 0]], dtype=torch.int32)
    lens = torch.tensor([7, 2], dtype=torch.int32)
    query = torch.randn(2, 4, 16)
    auto = get_backend("auto")
    expected = paged_decode_attention_reference(query, k_cache, v_cache, tables, lens, 0.25)
    assert torch.equal(auto.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.25), expected)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q = torch.randn(5, 4, 16)
    expected = paged_prefill_attention_reference(q, k_cache, v_cache, tables, cu, lens, 0.25)
    assert torch.equal(kernels.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.25), expected)


def test_triton_backend_loads_without_shadowing_functions(triton_available):
    backend = get_backend("triton")
    assert backend.name == "triton"
    # Importing the Triton submodules must not rebind kernels.store_kvcache & co.
    assert callable(kernels.store_kvcache) and kernels.store_kvcache.__module__ == "kernels"
    assert kernels.paged_decode_attention.__module__ == "kernels"
    assert kernels.paged_prefill_attention.__module__ == "kernels"


def test_import_does_not_load_triton():
    code = ("import sys, torch; before = 'triton' in sys.modules; import kernels; "
            "assert not {'kernels.paged_attention', 'kernels.paged_decode', 'kernels.paged_prefill'} & set(sys.modules); "
            "assert not {'kernels.store_kvcache_triton', 'kernels.quant_triton'} & set(sys.modules); "
            "assert before or 'triton' not in sys.modules, 'import kernels imported triton'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)


def test_decode_split_heuristic(triton_available):
    from kernels.paged_decode import DEFAULT_PARTITION_SIZE, choose_decode_partitions

    # Enough (seq, kv head) programs to fill the GPU: never split.
    assert choose_decode_partitions(128, 8, 32768, num_sms=132) == 1
    # Short contexts: nothing to split.
    assert choose_decode_partitions(1, 8, DEFAULT_PARTITION_SIZE, num_sms=132) == 1
    # One long sequence: one partition per DEFAULT_PARTITION_SIZE tokens.
    assert choose_decode_partitions(1, 8, 32768, num_sms=132) == 32768 // DEFAULT_PARTITION_SIZE
    assert choose_decode_partitions(2, 4, 1000, num_sms=132) == 2


def test_the_config_lists_the_same_backends():
    from engine.config import KERNEL_BACKENDS

    assert KERNEL_BACKENDS == kernels.BACKEND_NAMES
