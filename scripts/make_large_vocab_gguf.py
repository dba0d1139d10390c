"""A model with a large vocabulary, made from the shipped one: SmolLM2-135M with its 49,152-token
vocabulary padded to 200,064 tokens (the size of OpenAI's o200k tokenizers; Gemma's is 256k).

    python scripts/make_large_vocab_gguf.py [--vocab 200064] [--out PATH]

Weights as F16 (norms F32); the added tokens are unused-type entries `<|extra_N|>` whose
embedding rows are drawn (seeded) with the spread of the real rows, so the output layer (tied
to the embedding) scores every one of the 200k tokens at every step, as a large-vocabulary
model does. It is a throughput fixture for `bench_llamacpp_overhead.py --model`, not a model
to read outputs from. Prints the path (default: the harness's model cache).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.models.catalog import cache_dir, resolve_gguf  # noqa: E402
from harness.models.gguf_convert import copy_fields  # noqa: E402

UNUSED = 5  # llama.cpp's token type for reserved, never-produced-by-text tokens


def make(source: Path, target: Path, vocab: int, seed: int = 0) -> None:
    import gguf

    reader = gguf.GGUFReader(str(source))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    extra = vocab - len(tokens)
    if extra <= 0:
        raise SystemExit(f"{source} already has {len(tokens)} tokens")

    def padded(name: str, value: Any) -> Any:
        if name == "tokenizer.ggml.tokens":
            return tokens + [f"<|extra_{i}|>" for i in range(extra)]
        if name == "tokenizer.ggml.token_type":
            return list(value) + [UNUSED] * extra
        if name == "tokenizer.ggml.scores":
            return list(value) + [0.0] * extra
        return vocab if name.endswith(".vocab_size") else value

    writer = copy_fields(reader, target, padded)
    writer.add_file_type(1)  # mostly F16
    rng = np.random.default_rng(seed)
    for tensor in reader.tensors:
        data = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if tensor.name in ("token_embd.weight", "output.weight"):
            rows = rng.normal(data.mean(), data.std(), size=(extra, data.shape[1])).astype(np.float32)
            data = np.concatenate([data, rows])
        writer.add_tensor(tensor.name, data if data.ndim == 1 else data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=200_064)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    source = resolve_gguf("smollm2-135m", ROOT)
    target = args.out or cache_dir() / f"{source.stem}-vocab{args.vocab}-f16.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        make(source, tmp, args.vocab)
        tmp.replace(target)
    print(target)


if __name__ == "__main__":
    main()
