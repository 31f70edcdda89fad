
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smol():
    """The default target (SmolLM2-135M-Instruct) with plain decoding, float32-accurate inputs
    (what Hugging Face's float32 model of the file computes, within rounding)."""
    import jakiro
    return jakiro.load(int8_activations=False)


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
