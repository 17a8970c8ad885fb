"""GGUF files of real model shapes with random weights, for the GGUF benchmarks.

    python scripts/make_gguf_shape.py SHAPE OUT_DIR [--types Q4_K_M Q8_0]

SHAPE is qwen3-0.6b or llama-3.2-1b (their configs' sizes, tied embeddings).
Writes OUT_DIR/SHAPE-F16.gguf with the `gguf` package's writer (weights
uniform in [-0.05, 0.05), norms 1), then each quantized file with llama.cpp's
own llama-quantize from scripts/build_llama_server.sh's build: the K-quant
mixes (Q4_K_M: Q6_K for half of attn_v/ffn_down and the head) are llama.cpp's
choice, as in a file a user downloads. Random weights give meaningless
text; the speed of a step does not depend on the values.

The tokenizer is SmolLM2's (from the default model's file), padded with
unused tokens to the shape's vocabulary, so both servers load the file.
Benchmark-only: llama-quantize is never a dependency of pagedserve.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import numpy as np

SHAPES = {
    "qwen3-0.6b": dict(arch="qwen3", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                       ffn=3072, vocab=151936, rope_base=1e6, eps=1e-6, qk_norm=True),
    "llama-3.2-1b": dict(arch="llama", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
                         ffn=8192, vocab=128256, rope_base=5e5, eps=1e-5, qk_norm=False),
}
CONTEXT = 8192


def write_f16(shape: dict, path: Path) -> None:
    import gguf

    from engine.model.models.loader import default_gguf_path

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), shape["arch"])
    hidden, heads, kv, dim = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(dim)
    writer.add_rope_freq_base(shape["rope_base"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(writer, gguf.GGUFReader(str(default_gguf_path())), shape["vocab"])

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.uniform(-0.05, 0.05, size=(rows, cols)).astype(np.float16)

    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", matrix(shape["vocab"], hidden))
    writer.add_tensor("output_norm.weight", ones)
    for i in range(shape["layers"]):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", ones)
        writer.add_tensor(blk + "attn_q.weight", matrix(heads * dim, hidden))
        writer.add_tensor(blk + "attn_k.weight", matrix(kv * dim, hidden))
        writer.add_tensor(blk + "attn_v.weight", matrix(kv * dim, hidden))
        writer.add_tensor(blk + "attn_output.weight", matrix(hidden, heads * dim))
        if shape["qk_norm"]:
            writer.add_tensor(blk + "attn_q_norm.weight", np.ones(dim, dtype=np.float32))
            writer.add_tensor(blk + "attn_k_norm.weight", np.ones(dim, dtype=np.float32))
        writer.add_tensor(blk + "ffn_norm.weight", ones)
        writer.add_tensor(blk + "ffn_gate.weight", matrix(shape["ffn"], hidden))
        writer.add_tensor(blk + "ffn_up.weight", matrix(shape["ffn"], hidden))
        writer.add_tensor(blk + "ffn_down.weight", matrix(hidden, shape["ffn"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def copy_tokenizer(writer, source, vocab: int) -> None:
    """SmolLM2's BPE tokenizer, its token list padded with unused tokens to `vocab`."""
    def field(name):
        return source.fields[name].contents()

    tokens, types = list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.token_type"))
    tokens += [f"<|unused_{i}|>" for i in range(vocab - len(tokens))]
    types += [5] * (vocab - len(types))  # llama.cpp's token type UNUSED
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(field("tokenizer.ggml.merges")))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_chat_template(field("tokenizer.chat_template"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--types", nargs="*", default=["Q4_K_M", "Q8_0"])
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    f16 = args.out_dir / f"{args.shape}-F16.gguf"
    if not f16.exists():
        write_f16(SHAPES[args.shape], f16)
    repo = Path(__file__).resolve().parents[1]
    server = subprocess.run(["bash", str(repo / "scripts/build_llama_server.sh")], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    quantize = Path(server).with_name("llama-quantize")
    for kind in args.types:
        out = args.out_dir / f"{args.shape}-{kind}.gguf"
        if not out.exists():
            subprocess.run([str(quantize), str(f16), str(out), kind], check=True)
        print(out)


if __name__ == "__main__":
    main()
