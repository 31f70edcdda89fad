"""Writes this folder with speculators 0.9.0 (Red Hat's EAGLE-3 trainer, the `speculators` wheel on
PyPI), not with jakiro: a one-layer EAGLE-3 draft for the tests' tiny eight-layer Llama target
(random weights, a 48-token draft vocabulary), saved by its ``save_pretrained``, and the logits
its own forward gives for random target streams (``reference_logits.safetensors``). Not run by
the tests; rerun by hand:

    pip install --no-deps --target /tmp/spdeps speculators==0.9.0 loguru pydantic-settings typer rich \
        datasets multiprocess pandas pyarrow dill xxhash hs-connectors
    cd tests && PYTHONPATH=/tmp/spdeps ../.venv/bin/python data/eagle3-speculators/make.py
"""

import copy
import os

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from helpers import make_tiny_target
from speculators.models.eagle3.core import Eagle3DraftModel

HERE = os.path.dirname(os.path.abspath(__file__))
target = make_tiny_target("/tmp/eagle3-speculators-target", "llama", num_hidden_layers=8, eos_token_id=None)
layer = copy.deepcopy(AutoConfig.from_pretrained(target))
layer.num_hidden_layers = 1
g = torch.Generator().manual_seed(0)
ids = torch.randperm(256, generator=g)[:48].sort().values
t2d = torch.zeros(256, dtype=torch.bool)
t2d[ids] = True
model = Eagle3DraftModel.from_training_args(layer, t2d=t2d, d2t=ids - torch.arange(48), verifier_name_or_path=target,
                                            draft_vocab_size=48, norm_before_residual=False, ttt_steps=3,
                                            target_layer_ids=[2, 4, 5], draft_attn_impl="eager")
torch.manual_seed(1)
with torch.no_grad():
    for name, p in model.named_parameters():
        if not name.startswith(("embed_tokens", "verifier")):
            p.normal_(0, 0.2) if p.ndim == 2 else p.copy_(1 + 0.1 * torch.randn_like(p))
model.save_pretrained(HERE)
os.remove(os.path.join(HERE, "config.py"))  # its remote-code shim; the config and weights are what loaders read
model = Eagle3DraftModel.from_pretrained(HERE).eval()
g = torch.Generator().manual_seed(3)
T = 12
streams = torch.randn(1, T, 192, generator=g)
tokens = torch.randint(0, 256, (1, T), generator=g)  # the token after each position
logits = []
hook = model.lm_head.register_forward_hook(lambda mod, inp, out: logits.append(out.detach().clone()))
with torch.no_grad():
    model(hidden_states=streams, input_ids=tokens, document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=1)
hook.remove()
save_file({"hidden_states": streams[0].contiguous(), "input_ids": tokens[0].contiguous(),
           "logits": logits[0][0].contiguous()}, os.path.join(HERE, "reference_logits.safetensors"))
