"""One source of settings: the dataclasses give the API's keyword arguments and the command
line's options and defaults; the runtime choices travel in one object, the environment only
setting its defaults."""

import os

import pytest

from jakiro.cli_options import _config_from, build_parser, runtime_from
from jakiro.errors import JakiroError
from jakiro.settings import DecodeSettings, MethodSettings, Runtime, ServeSettings, cli_fields, settings_with


def test_the_environment_sets_the_runtimes_defaults_and_given_choices_win(monkeypatch):
    for name in ("JAKIRO_THREADS", "JAKIRO_QUANTIZED", "JAKIRO_INT8_ACTIVATIONS", "JAKIRO_KV_CACHE"):
        monkeypatch.delenv(name, raising=False)
    assert Runtime.from_env() == Runtime(None, True, None)
    monkeypatch.setenv("JAKIRO_THREADS", "3")
    monkeypatch.setenv("JAKIRO_QUANTIZED", "0")
    monkeypatch.setenv("JAKIRO_INT8_ACTIVATIONS", "1")
    assert Runtime.from_env() == Runtime(3, False, True)
    assert Runtime.from_env(threads=1, quantized=True, int8_activations=False) == Runtime(1, True, False)
    monkeypatch.setenv("JAKIRO_INT8_ACTIVATIONS", "auto")
    assert Runtime.from_env().int8_activations is None
    monkeypatch.setenv("JAKIRO_KV_CACHE", "float16")
    assert Runtime.from_env().kv_cache == "float16" and Runtime.from_env(kv_cache="float32").kv_cache == "float32"
    monkeypatch.setenv("JAKIRO_KV_CACHE", "half")
    with pytest.raises(JakiroError, match="the KV cache holds float32 or float16, not 'half'"):
        Runtime.from_env()
    monkeypatch.delenv("JAKIRO_KV_CACHE")
    monkeypatch.setenv("JAKIRO_THREADS", "two")
    with pytest.raises(JakiroError, match="JAKIRO_THREADS must be a number, got 'two'"):
        Runtime.from_env()
    with pytest.raises(JakiroError, match="--threads must be >= 1, got 0"):
        Runtime(threads=0)


def test_the_command_line_passes_its_runtime_choices_in_an_object_not_the_environment(monkeypatch):
    monkeypatch.delenv("JAKIRO_THREADS", raising=False)
    monkeypatch.setenv("JAKIRO_INT8_ACTIVATIONS", "1")
    before = dict(os.environ)
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--float32-inputs", "--float32", "--threads", "2"])
    assert runtime_from(args) == Runtime(2, False, False)
    assert runtime_from(parser.parse_args(["generate", "--prompt", "x"])) == Runtime(None, True, True)  # the env's
    assert runtime_from(parser.parse_args(["serve", "--kv-cache", "float32"])).kv_cache == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--kv-cache", "int8"])
    assert dict(os.environ) == before


def test_command_line_defaults_are_the_settings_defaults():
    parser = build_parser()
    generate = parser.parse_args(["generate", "--prompt", "x"])
    assert _config_from(generate, DecodeSettings) == DecodeSettings()
    assert _config_from(generate, MethodSettings) == MethodSettings()
    assert _config_from(parser.parse_args(["chat"]), DecodeSettings) == DecodeSettings()
    assert _config_from(parser.parse_args(["serve"]), ServeSettings) == ServeSettings()
    for cls, command in ((DecodeSettings, ["generate", "--prompt", "x"]), (MethodSettings, ["chat"]),
                         (ServeSettings, ["serve"])):
        options = {a.dest: a for a in parser._subparsers._group_actions[0].choices[command[0]]._actions}
        for name, flag, default, meta in cli_fields(cls):
            assert name in options and flag in options[name].option_strings and options[name].help == meta["help"]


def test_command_line_options_reach_the_settings():
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--max-new-tokens", "7", "--top-k", "5", "--stop", "a",
                              "--stop", "b", "--tree-top-k", "3", "--no-parallel", "--no-adaptive",
                              "--no-prompt-vocab", "--method", "jakiro", "--candidates", "blended"])
    assert _config_from(args, DecodeSettings) == DecodeSettings(max_new_tokens=7, top_k=5, stop=("a", "b"))
    assert _config_from(args, MethodSettings) == MethodSettings(
        method="jakiro", tree_top_k=3, parallel_decoding=False, adaptive=False, prompt_vocab=False,
        candidate_mode="blended")
    serve = parser.parse_args(["serve", "--allowed-hosts", "a.example, b.example,", "--parallel", "4"])
    assert _config_from(serve, ServeSettings).allowed_hosts == ("a.example", "b.example")
    assert _config_from(serve, ServeSettings).parallel == 4


@pytest.mark.parametrize("cls, options, message", [
    (ServeSettings, dict(port=0), "--port must be in 1..65535, got 0"),
    (ServeSettings, dict(slot_tokens=1), "--slot-tokens must be >= 2, got 1"),
    (ServeSettings, dict(header_timeout=0.0), "--header-timeout must be > 0"),
    (ServeSettings, dict(max_connections=0), "--max-connections must be >= 1, got 0"),
    (MethodSettings, dict(depth=0), "--depth must be >= 1, got 0"),
    (DecodeSettings, dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
    (DecodeSettings, dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
])
def test_bad_settings_are_refused_where_they_are_made(cls, options, message):
    with pytest.raises(JakiroError, match=message):
        cls(**options)


def test_an_unknown_keyword_names_the_settings_fields():
    import jakiro
    with pytest.raises(TypeError, match=r"unknown option top_k for MethodSettings \(its fields: .*tree_top_k"):
        jakiro.load(top_k=3)  # the sampling filter's name; the tree's is tree_top_k
    assert settings_with(DecodeSettings(), {"seed": 4}) == DecodeSettings(seed=4)


def test_the_api_key_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("JAKIRO_API_KEY", "s3cret")
    assert ServeSettings().api_key == "s3cret" and ServeSettings(api_key="other").api_key == "other"
    monkeypatch.delenv("JAKIRO_API_KEY")
    assert ServeSettings().api_key is None


def test_a_loaded_target_says_which_runtime_it_runs(tiny_llama_dir):
    from jakiro.models.target import TargetModel
    model = TargetModel.from_folder(tiny_llama_dir, Runtime(threads=None, quantized=True, int8_activations=None))
    # a Hugging Face folder: float weights, float inputs, float32 keys and values
    assert model.runtime == Runtime(None, False, False, "float32")
