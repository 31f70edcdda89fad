
import os

import pytest
import torch
from jakiro.settings import Runtime

torch.set_num_threads(1)
# Float32-accurate inputs unless a test asks for int8 ones: the default (int8 where the CPU has
# AVX-512 VNNI or AMX) would make expected texts depend on the machine running the tests; the
# int8 paths have their own tests, and subprocesses inherit this.
os.environ.setdefault("JAKIRO_INT8_ACTIVATIONS", "0")


@pytest.fixture(scope="session")
def smol():
    """The default target (SmolLM2-135M-Instruct) with plain decoding, float32-accurate inputs
    (what Hugging Face's float32 model of the file computes, within rounding)."""
    import jakiro
    return jakiro.load(runtime=Runtime.from_env(int8_activations=False))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from helpers import make_tiny_target
    return make_tiny_target(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny target without EOS, a character tokenizer, 20 Spec-Bench prompts and their plain
    greedy continuations (N_TOKENS each): the reference for greedy-equivalence tests."""
    from helpers import CharTokenizer, make_tiny_target, spec_bench_prompts
    from jakiro.decoding.engine import Engine
    from jakiro.models.target import TargetModel
    from test_speculative_greedy import N_PROMPTS, N_TOKENS
    root = tmp_path_factory.mktemp("greedy")
    target = TargetModel.from_folder(make_tiny_target(str(root / "target"), "llama", eos_token_id=None))
    tok = CharTokenizer()
    tok.eos_token_id = None  # no EOS: every run produces all 128 tokens
    prompts = [tok(p).input_ids[:200] for p in spec_bench_prompts(N_PROMPTS)]
    reference = [Engine(target, tok).generate(p, N_TOKENS).token_ids for p in prompts]
    assert all(len(r) == N_TOKENS for r in reference)
    return root, target, tok, prompts, reference


OPT_IN = ("large", "llamacpp")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``large`` (models of a gigabyte pulled with ``jakiro models pull``) or
    ``llamacpp`` (llama.cpp built by scripts/build_llama_cpp.sh) run only when ``-m`` names their
    marker, so that ``-m "not slow"`` stays the fast tier and CI needs neither."""
    named = [m for m in OPT_IN if m in (config.option.markexpr or "")]
    kept = [item for item in items
            if not any(item.get_closest_marker(m) is not None and m not in named for m in OPT_IN)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
