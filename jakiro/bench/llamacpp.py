"""llama.cpp as a baseline: its ``llama-server`` on the same GGUF file and threads, asked for the
same prompt tokens, greedy or sampled, beside our methods (``jakiro bench --methods
ar,llamacpp,llamacpp-pld``). ``llamacpp`` is plain decoding; ``llamacpp-pld`` its n-gram
speculation over the prompt and answer (``--spec-type ngram-simple``), llama.cpp's prompt lookup;
``llamacpp-draft`` its speculative decoding with a small model of the family (``--spec-type
draft-simple --spec-draft-model``, its default of 3 drafted tokens), as ``draft-model`` here;
``llamacpp-eagle3`` its ``--spec-type draft-eagle3`` with our EAGLE-3 draft exported to GGUF.

The binaries come from ``scripts/build_llama_cpp.sh`` (llama.cpp from the source PyPI's
``llama-cpp-python`` vendors), found in ``$JAKIRO_LLAMA_CPP`` or ``<cache>/llama.cpp/bin``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

from ..errors import JakiroError

DRAFT_FILE = "{draft}"  # stands for the draft model's GGUF file in SERVER_OPTIONS
EAGLE3_FILE = "{eagle3}"  # our EAGLE-3 draft exported for llama.cpp (``jakiro export --format gguf``)
CHAIN = "{chain}"  # the tokens it drafts per step: the benchmark's --depth, else 3
SERVER_OPTIONS = {"llamacpp": (), "llamacpp-pld": ("--spec-type", "ngram-simple"),
                  "llamacpp-draft": ("--spec-type", "draft-simple", "--spec-draft-model", DRAFT_FILE),
                  # a fixed chain (no early stop on the draft's confidence), as ``eagle3 --depth N --top-k 1``
                  "llamacpp-eagle3": ("--spec-type", "draft-eagle3", "--spec-draft-model", EAGLE3_FILE,
                                      "--spec-draft-n-max", CHAIN, "--spec-draft-n-min", CHAIN,
                                      "--spec-draft-p-min", "0")}


def binaries(cache: str | None = None) -> str:
    """The folder holding ``llama-server`` (and ``llama-bench``), or a clear error."""
    from ..models.hub import cache_dir
    folder = os.environ.get("JAKIRO_LLAMA_CPP") or os.path.join(cache_dir(cache), "llama.cpp", "bin")
    if not os.access(os.path.join(folder, "llama-server"), os.X_OK):
        raise JakiroError(f"llama.cpp is not built here (no llama-server in {folder}): run "
                          "scripts/build_llama_cpp.sh, or point JAKIRO_LLAMA_CPP at a folder of its binaries")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One ``llama-server`` process on a GGUF file, for ``complete`` requests on token ids."""

    def __init__(self, gguf: str, threads: int, extra: tuple[str, ...] = (), context: int = 4096,
                 cache: str | None = None, timeout: float = 300.0):
        self.port = _free_port()
        cmd = [os.path.join(binaries(cache), "llama-server"), "-m", gguf, "-t", str(threads), "-tb", str(threads),
               "-c", str(context), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
               *extra]
        self.log = open(os.devnull, "w")
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while True:
            if self.process.poll() is not None:
                raise JakiroError(f"llama-server exited with code {self.process.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                self.close()
                raise JakiroError(f"llama-server did not come up in {timeout:.0f} s")
            time.sleep(0.2)
        # stopped between requests: its idle threads poll for work, which would take CPU from
        # whatever is timed meanwhile (its own polling while it works stays as llama.cpp sets it)
        self.process.send_signal(signal.SIGSTOP)

    def complete(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> dict:
        """Generate after the prompt ``ids`` (no prompt cache: every request prefills anew).
        Returns the token ids, the decoding seconds (after the prompt), the whole request's and
        llama.cpp's draft counts where it speculates."""
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": temperature, "seed": seed,
                "cache_prompt": False, "return_tokens": True, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "repeat_penalty": 1.0}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        self.process.send_signal(signal.SIGCONT)
        try:
            t0 = time.perf_counter()
            with urllib.request.urlopen(request, timeout=3600) as r:
                out = json.load(r)
            total = time.perf_counter() - t0
        finally:
            self.process.send_signal(signal.SIGSTOP)
        timings = out.get("timings", {})
        return {"token_ids": out.get("tokens", []), "decode_s": timings.get("predicted_ms", 0.0) / 1e3,
                "prefill_s": timings.get("prompt_ms", 0.0) / 1e3, "total_s": total,
                "draft_tokens": timings.get("draft_n"), "accepted_tokens": timings.get("draft_n_accepted")}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
