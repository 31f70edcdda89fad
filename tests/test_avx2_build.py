"""The kernels as CPUs without AVX-512 get them (built here with -march=x86-64-v3, AVX2 and FMA,
and run in a process of their own): every packed block type reads back GGUF's reference weights
exactly through the AVX2 integer kernel and the portable one, stays within float32 accuracy on
random inputs, keeps rows independent, and a tiny Q4_K_M-like model gives the native build's
greedy tokens."""

import os
import subprocess
import sys

import pytest

from jakiro.models import smallgemm

CHECK = r'''
import sys, torch
sys.path.insert(0, {tests!r})
from jakiro.models import smallgemm
smallgemm._build_dir = lambda: {build!r}
assert smallgemm.available(), smallgemm.status()
assert not smallgemm.int8_activations_usable()  # no VNNI in this build: float32-accurate inputs
from gguf_models import PACKED, random_blocks, reference
for kind in PACKED:
    raw = random_blocks(kind, 40, 512, seed=1)
    w = torch.from_numpy(reference(raw, kind))
    packed = smallgemm.kq_pack(torch.from_numpy(raw))
    assert torch.equal(smallgemm.quantized_linear(torch.eye(512), packed, 40).T.contiguous(), w), kind.name
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(0))
    y = smallgemm.quantized_linear(x, packed, 40)
    bound = 2.0 ** -21 * (x.abs().double() @ w.abs().double().T) * 32 + 1e-5
    assert bool(((y.double() - x.double() @ w.double().T).abs() <= bound).all()), kind.name
    assert torch.equal(smallgemm.quantized_linear(x[4:5], packed, 40), y[4:5]), kind.name
    with smallgemm.int8_disabled():
        assert torch.equal(smallgemm.quantized_linear(torch.eye(512), packed, 40).T.contiguous(), w), kind.name
from jakiro.models.hub import resolve_target
from jakiro.models.target import TargetModel
from jakiro.decoding.engine import Engine
from jakiro.api import load_tokenizer
folder = resolve_target({model!r}, cache={cache!r})
print(Engine(TargetModel.from_folder(folder), load_tokenizer(folder)).generate(list(range(40, 60)), 24).token_ids)
'''


@pytest.mark.skipif(not smallgemm.available() or "avx2" not in open("/proc/cpuinfo").read(),
                    reason="needs the C++ kernels and an AVX2 CPU")
@pytest.mark.slow
def test_the_avx2_build_computes_what_the_native_one_does(tmp_path):
    from gguf_models import write_model
    from jakiro.api import load_tokenizer
    from jakiro.decoding.engine import Engine
    from jakiro.models.hub import resolve_target
    from jakiro.models.target import TargetModel
    from jakiro.settings import Runtime
    build = str(tmp_path / "build")
    os.makedirs(build)
    code = (f"from torch.utils.cpp_extension import load; load(name='jakiro_smallgemm', sources={[smallgemm.SOURCE, *smallgemm.MORE_SOURCES]!r}, "
            f"extra_cflags=['-O2', '-march=x86-64-v3', '-ffp-contract=fast', '-fopenmp'], extra_ldflags=['-fopenmp'], "
            f"build_directory={build!r}, is_python_module=False)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    path = write_model(str(tmp_path / "m.gguf"), "qwen2", layers=2)
    cache = str(tmp_path / "cache")
    folder = resolve_target(path, cache=cache)
    native = Engine(TargetModel.from_folder(folder, Runtime.from_env(int8_activations=False)), load_tokenizer(folder))
    expected = native.generate(list(range(40, 60)), 24).token_ids
    tests = os.path.dirname(os.path.abspath(__file__))
    script = CHECK.format(tests=tests, build=build, model=path, cache=cache)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=dict(os.environ, JAKIRO_INT8_ACTIVATIONS="auto"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == str(expected)
