
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smol():
    """The default target (SmolLM2-135M-Instruct) with plain decoding."""
    import jakiro
    return jakiro.load()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from helpers import make_tiny_target
    return make_tiny_target(str(tmp_path_factory.mktemp("tiny_llama")), "llama")
