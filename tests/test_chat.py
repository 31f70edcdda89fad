"""``jakiro chat`` through its input/output streams and through a pseudo-terminal."""

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest


def session(smol, **kw):
    from jakiro.chat import ChatSession
    from jakiro.settings import DecodeSettings
    kw.setdefault("max_new_tokens", 16)
    system = kw.pop("system", None)
    return ChatSession(smol.engine("jakiro"), DecodeSettings(**kw), system)


def test_chat_streams_replies_keeps_history_and_reports(smol):
    from jakiro.chat import run_chat
    engine = smol.engine("jakiro")
    first = engine.generate("What is 2+2?", 16).text
    history = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "And times 3?"}]
    second = engine.generate(history, 16).text
    s = session(smol)
    out = io.StringIO()
    run_chat(s, io.StringIO("What is 2+2?\nAnd times 3?\n/stats\n/reset\n/stats\n/bogus\n/quit\n"), out)
    text = out.getvalue()
    assert f"bot> {first}\n[" in text
    assert f"bot> {second}\n[" in text  # the second turn saw the first one
    turns = re.findall(r"\[(\d+) tokens, ([\d.]+) tokens/s, tau ([\d.]+), jakiro; first token after [\d.]+ s", text)
    assert len(turns) == 2
    # the second turn starts from what the first left in the cache (the first turn's prompt, at least)
    second_line = re.findall(r"\[\d+ tokens, [^\n]*\]\n", text)[1]
    cached = re.search(r"(\d+) of (\d+) prompt tokens from the cache\]", second_line)
    assert cached and int(cached.group(1)) >= len(engine.encode("What is 2+2?"))
    # every kept token but each turn's first comes from a verification forward: tau = (tokens - 1) / forwards
    forwards = [(int(n) - 1) / float(tau) for n, _, tau in turns]
    assert all(abs(f - round(f)) < 0.05 * f and round(f) >= 1 for f in forwards), turns
    stats = re.findall(r"\[session: (\d+) turns, (\d+) tokens, .*?(\d+) messages in history", text)
    assert stats[0][0] == "2" and int(stats[0][1]) == sum(int(n) for n, _, _ in turns) and stats[0][2] == "4"
    assert "[conversation cleared]" in text
    assert stats[1] == ("0", "0", "0")
    assert "unknown command /bogus" in text
    assert text.rstrip().endswith("bye")


def test_chat_drops_old_turns_when_the_context_is_full_and_survives_errors(smol, monkeypatch):
    from jakiro.chat import run_chat
    s = session(smol, system="Be brief.")
    monkeypatch.setattr(smol.target.config, "max_context", 80)
    out = io.StringIO()
    long = "word " * 200
    run_chat(s, io.StringIO(f"Hello there.\nHow are you?\nTell me a joke.\n{long}\nBye!\n"), out)
    text = out.getvalue()
    assert "oldest messages are left out" in text
    assert "do not fit in the model's context (80 tokens)" in text
    assert s.history[0] == {"role": "system", "content": "Be brief."}
    assert s.history[-2] == {"role": "user", "content": "Bye!"}
    assert all(m["content"] != long.strip() for m in s.history)


def read_until(fd, marker, timeout=300):
    buf = b""
    deadline = time.time() + timeout
    while marker not in buf:
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {marker!r}; got {buf[-500:]!r}")
        r, _, _ = select.select([fd], [], [], 1)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf.decode(errors="replace")


@pytest.mark.slow
def test_chat_command_in_a_pseudo_terminal(smol):
    expected = smol.engine("jakiro").generate("Name a fruit.", 12).text
    master, slave = pty.openpty()
    env = dict(os.environ, OMP_NUM_THREADS="1", TERM="dumb")
    proc = subprocess.Popen([sys.executable, "-m", "jakiro", "chat", "--max-new-tokens", "12", "--threads", "1"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    try:
        read_until(master, b"you> ")
        os.write(master, b"Name a fruit.\r")
        reply = read_until(master, b"you> ")
        assert expected.replace("\n", "\r\n") in reply
        assert re.search(r"tokens/s, tau \d", reply)
        os.write(master, b"/stats\r")
        assert "[session: 1 turns" in read_until(master, b"you> ")
        os.write(master, b"/quit\r")
        read_until(master, b"bye")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.slow
def test_chat_command_rejects_bad_options():
    for args, message in ((["--temperature", "-1"], "temperature must be a finite number >= 0"),
                          (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer, got 0"),
                          (["--draft", "/nonexistent/draft"], "/nonexistent/draft")):
        res = subprocess.run([sys.executable, "-m", "jakiro", "chat", *args], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
