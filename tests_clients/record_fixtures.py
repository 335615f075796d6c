"""Record what transformers itself writes and holds, for the main suite's pinned fixtures.

Run in the client venv that ``tools/test-clients`` builds (transformers 5.25)::

    .venv-clients-hf/bin/python tests_clients/record_fixtures.py   # writes tests/fixtures/clients/transformers-*.json

Each file names the client and version and holds, for one tiny model kind, the ``config.json``
transformers' ``save_pretrained`` writes and every tensor of the checkpoint as ``[dtype, shape]``
(safetensors dtype names). ``transformers-llama-fp8`` is the state dict transformers' fine-grained FP8
model holds (FP8 linears, float32 ``weight_scale_inv`` per block) for a folder whose
``quantization_config`` has block 32: the keys a ``--quantize fp8-block:32`` output must have. The
main suite (tests/test_client_fixtures.py) rebuilds checkpoints from these without transformers, so
``tools/test`` catches a renamed key, a dropped tensor or a wrong config field.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "hf"))

from conftest import make_bert, make_llama  # noqa: E402  (the client suite's own model builders)

FP8_BLOCK = 32
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
}


def saved_tensors(folder: Path) -> dict[str, list[Any]]:
    from safetensors import safe_open

    tensors: dict[str, list[Any]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(key)
                tensors[key] = [sl.get_dtype(), list(sl.get_shape())]
    return dict(sorted(tensors.items()))


def record_saved(kind: str, folder: Path) -> dict[str, Any]:
    import transformers

    return {
        "client": "transformers",
        "version": transformers.__version__,
        "kind": kind,
        "recorded_by": "tests_clients/record_fixtures.py",
        "config": json.loads((folder / "config.json").read_text()),
        "tensors": saved_tensors(folder),
    }


def record_fp8_llama(folder: Path) -> dict[str, Any]:
    """The state dict transformers' FP8 Llama holds (built on the meta device, as on a GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers import AutoHfQuantizer

    quantization = FineGrainedFP8Config(weight_block_size=[FP8_BLOCK, FP8_BLOCK])
    config = AutoConfig.from_pretrained(folder)
    config.quantization_config = json.loads(quantization.to_json_string())
    quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    quantizer._process_model_before_weight_loading(model)
    record = record_saved("llama-fp8", folder)
    record["config"]["quantization_config"] = config.quantization_config
    record["tensors"] = {k: [SAFETENSORS_DTYPES[v.dtype], list(v.shape)] for k, v in sorted(model.state_dict().items())}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "tests" / "fixtures" / "clients")
    out: Path = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        records = {
            "transformers-llama": record_saved("llama", make_llama(work / "llama")),
            "transformers-bert": record_saved("bert", make_bert(work / "bert")),
            "transformers-llama-fp8": record_fp8_llama(make_llama(work / "llama-bf16", dtype=torch.bfloat16)),
        }
    for name, record in records.items():
        (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{out / name}.json: {len(record['tensors'])} tensors")


if __name__ == "__main__":
    main()
