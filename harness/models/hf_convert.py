"""Write a GGUF's weights as a float32 Hugging Face checkpoint, for engines that read those."""

from __future__ import annotations

from pathlib import Path


def export(source: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # The weights are dequantized now: drop the GGUF marker so the folder loads as plain float32.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
