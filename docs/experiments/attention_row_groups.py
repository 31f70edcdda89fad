"""The target's forward over 1, 2, 4 and 8 new tokens after a short and a long context, with the
rows attending in groups that read the cached keys and values once (the default) and one by one
(``smallgemm.row_groups_disabled``), interleaved in one process (the results are bitwise the same).

    python docs/experiments/attention_row_groups.py --threads 2 --contexts 128,768,1536 [--int8-activations]
"""

from __future__ import annotations

import argparse
import contextlib

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="128,768,1536")
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--int8-activations", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import jakiro
    from jakiro.decoding.costs import interleaved_ms, prefilled_cache
    from jakiro.models import smallgemm
    target = jakiro.load(int8_activations=args.int8_activations).target
    sizes = [int(n) for n in args.sizes.split(",")]
    for context in (int(c) for c in args.contexts.split(",")):
        cache = prefilled_cache(target, context, max(sizes))
        calls = {}
        for grouped in (True, False):
            for n in sizes:
                ids = torch.randint(0, target.config.vocab_size, (n,))
                mask = torch.ones(n, n, dtype=torch.bool).tril_()

                def forward(ids=ids, mask=mask, n=n, grouped=grouped):
                    with torch.inference_mode(), (contextlib.nullcontext() if grouped
                                                  else smallgemm.row_groups_disabled()):
                        target(ids, cache, torch.arange(context, context + n), mask if n > 1 else None)
                calls[grouped, n] = forward
        ms = interleaved_ms(calls, args.repeats, warmup=2, primed=1)
        for grouped in (True, False):
            print(f"context {context:5d} {'row groups' if grouped else 'row by row'}: " +
                  "  ".join(f"t({n}) {ms[grouped, n]:.2f} ms" for n in sizes))


if __name__ == "__main__":
    main()
