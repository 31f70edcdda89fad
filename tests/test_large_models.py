"""The named Qwen2.5-Coder targets (opt in: `jakiro models pull qwen2.5-coder-1.5b` and
`... 0.5b`, then `pytest -m large`): greedy text of plain decoding equals Hugging Face's
`generate` on the same file (dequantized, float32) for 32 tokens, and every block type of the
files reads back bitwise as GGUF's reference."""

import pytest
import torch

from jakiro.models import registry
from jakiro.settings import Runtime

pytestmark = pytest.mark.large

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "What does a hash map do? Answer in two sentences.",
           "Fix the bug: def mean(xs): return sum(xs) / len(xs) - 1"]


def _pulled(name):
    path = registry.local_path(registry.named(name))
    if path is None:
        pytest.skip(f"{name} is not pulled (jakiro models pull {name})")
    return path


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_greedy_text_equals_hugging_face_generate(name):
    import jakiro
    from jakiro.models.gguf_file import hugging_face_model
    _pulled(name)
    jk = jakiro.load(target=name, runtime=Runtime.from_env(int8_activations=False))
    hf = hugging_face_model(jk.target_path)
    engine = jk.engine("ar")
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ours = engine.generate(ids, 32).token_ids
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        assert ours == out[0, len(ids):].tolist()[:len(ours)], prompt


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_every_block_type_reads_back_as_ggufs_reference(name):
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFReader, dequantize
    from jakiro.models import smallgemm
    reader = GGUFReader(_pulled(name))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type
        if len(t.shape) != 2 or kind.name in seen or kind.name in ("F32", "F16"):
            continue
        seen.add(kind.name)
        block, size = GGML_QUANT_SIZES[kind]
        cols = int(t.shape[0])
        raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:64].copy()
        got = smallgemm.gguf_rows(torch.from_numpy(raw).view(64, cols // block, size), torch.arange(64))
        assert torch.equal(got, torch.from_numpy(dequantize(raw, kind).astype(np.float32))), kind.name
    assert {"Q4_K", "Q6_K"} <= seen or {"Q5_0", "Q8_0"} <= seen
