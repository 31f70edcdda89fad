"""The small-batch linear kernel (``csrc/smallgemm.cpp``): y = x @ W^T for the 1-32 rows of a
decoding step, a verification tree or a draft step, streaming each weight once.

Built on first use (and by ``setup.sh``) with the machine's C++ compiler for its own CPU, cached
under the jakiro cache folder. Where it cannot be built (no compiler, no ninja) or where
``JAKIRO_NO_EXT=1``, the runtime says so once and uses torch's kernels: results stay within
float32 rounding of each other (the logits tests hold either way).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys

import torch

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCE = os.path.join(CSRC, "smallgemm.cpp")
MORE_SOURCES = (os.path.join(CSRC, "decoder.cpp"),)  # the fused decoder stack (``decoder_layers``)
HEADERS = (os.path.join(CSRC, "kernels.h"),)
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
_state: dict = {}


def _build_dir() -> str:
    from .hub import cache_dir
    return os.path.join(cache_dir(), "ext", f"smallgemm-{build_id()}")


def build_id() -> str:
    """Identifies the kernels' sources, compiler flags, torch and CPU: measurements taken with
    one build (tuned trees, cost curves) are not reused with another."""
    key = hashlib.sha256()
    for path in (SOURCE, *MORE_SOURCES, *HEADERS):
        with open(path, "rb") as f:
            key.update(f.read())
    key.update(" ".join([torch.__version__, sys.version, platform.machine(), *FLAGS, _cpu_flags()]).encode())
    return key.hexdigest()[:12]


def _cpu_flags() -> str:
    """The CPU's feature flags: a kernel built with -march=native is only reused on a CPU that
    has the same ones."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def available() -> bool:
    """Build (once per machine) and load the kernel; False, with one message, where impossible."""
    if "ok" in _state:
        return _state["ok"]
    _state["ok"] = False
    if os.environ.get("JAKIRO_NO_EXT"):
        _state["reason"] = "disabled by JAKIRO_NO_EXT"
        return False
    try:
        from torch.utils.cpp_extension import load
        build = _build_dir()
        os.makedirs(build, exist_ok=True)
        library = os.path.join(build, "jakiro_smallgemm.so")
        if os.path.exists(library):
            torch.ops.load_library(library)
        else:
            print("[jakiro] building the small-batch linear kernel for this CPU (once, ~20 s)", file=sys.stderr)
            load(name="jakiro_smallgemm", sources=[SOURCE, *MORE_SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                 build_directory=build, is_python_module=False, verbose=False)
        _state["ok"] = True
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's kernels still work
        _state["reason"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        print(f"[jakiro] small-batch linear kernel unavailable ({_state['reason']}); using torch's kernels",
              file=sys.stderr)
    return _state["ok"]


@contextlib.contextmanager
def disabled():
    """Layers built inside use torch's kernels (for side-by-side measurements)."""
    available()
    saved = dict(_state)
    _state.update(ok=False, reason="disabled for comparison")
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


def status() -> str:
    """'on', or 'off (why)': reported by ``jakiro bench-cost``."""
    return "on" if available() else f"off ({_state.get('reason', 'unavailable')})"


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.jakiro_smallgemm.pack(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.jakiro_smallgemm.linear(x, packed, out_features, bias)


def quantized_linear(x: torch.Tensor, kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """x @ W^T for W in GGUF blocks packed by ``quant.pack_blocks`` (kind ``q4_1`` or ``q8_0``)."""
    op = torch.ops.jakiro_smallgemm.q4_1_linear if kind == "q4_1" else torch.ops.jakiro_smallgemm.q8_0_linear
    return op(x, blocks)


def decoder_layers(x, weights, out_features, kv, past, cos, sin, tree_mask, num_heads, num_kv_heads, eps, scale):
    """The whole decoder stack for a few new tokens in one call (``csrc/decoder.cpp``); see
    ``TargetModel.forward``."""
    return torch.ops.jakiro_smallgemm.decoder_layers(x, weights, out_features, kv, past, cos, sin, tree_mask,
                                                     num_heads, num_kv_heads, eps, scale)


def draft_attend(x, fc, fc_bias, norm, qkv, o, kv, past, cos, sin, mask, num_heads, num_kv_heads, eps, scale):
    """A draft step's fusion layer and attention block in one call (``csrc/decoder.cpp``); see
    ``DraftModel.attend``."""
    return torch.ops.jakiro_smallgemm.draft_attend(x, fc, fc_bias, norm, qkv, o, kv, past, cos, sin, mask,
                                                   num_heads, num_kv_heads, eps, scale)
