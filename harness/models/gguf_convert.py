"""Rewrite a GGUF with every weight matrix in another dtype (dequantized with the gguf package).

Used to ask "same weights, other numeric format": Q4_1 as shipped vs F16 / BF16 / F32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

_FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_BF16


def copy_fields(reader: Any, target: Path, edit: Callable[[str, Any], Any] = lambda name, value: value) -> Any:
    """A GGUF writer for `target` holding the reader's metadata (each value passed through
    `edit(name, value)`), all but the file type, which the caller sets."""
    import gguf
    from gguf import GGUFValueType as V

    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == V.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, edit(name, field.contents()), vtype, sub)
    return writer


def convert(source: Path, target: Path, dtype: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(str(source))
    writer = copy_fields(reader, target)
    writer.add_file_type(_FILE_TYPE[dtype])

    for tensor in reader.tensors:
        data = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if data.ndim == 1 or dtype == "f32":  # norms and biases stay f32, as llama.cpp's converter does
            writer.add_tensor(tensor.name, data)
        elif dtype == "f16":
            writer.add_tensor(tensor.name, data.astype(np.float16))
        else:
            raw = gguf.quants.quantize(data, Q.BF16)
            writer.add_tensor(tensor.name, raw, raw_shape=data.shape, raw_dtype=Q.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
