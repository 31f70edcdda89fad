"""The results page and the README's tables come from benchmark JSON: regenerating writes the
figures of the files named in docs/results/sources.json between the README's markers (and
nothing else of the README changes), with the command and the machine under each table; the
repository's own page is what its data gives."""

import json
import os
import shutil

from jakiro.bench import results


def _tree(tmp_path, readme: str):
    (tmp_path / "docs" / "results" / "data").mkdir(parents=True)
    cost = {"int8_activations": True, "plain_decoding": {"ratio": 3.75},
            "forward_x_floor": {"1": 0.96}, "forward_x_t1": {"8": 1.37},
            "llamacpp_plain_decoding": {"ours_tokens_per_s": 22.1, "llamacpp_tokens_per_s": 12.0,
                                        "ours_over_llamacpp": 1.842}}
    bench = {"int8_activations": False, "methods": {
        "ar": {"all": {"tokens_per_s": 90.3, "speedup": 1.0, "tau": 1.0, "greedy_match": 1.0}},
        "pld": {"all": {"tokens_per_s": 115.1, "speedup": 1.2746, "tau": 1.7, "greedy_match": 1.0}},
        "llamacpp": {"all": {"tokens_per_s": 38.6, "speedup": 0.43, "tau": None, "greedy_match": 0.14}}}}
    conc = {"int8_activations": True,
            "methods": {"ar": {"1": {"tokens_per_s": 100.0, "vs_one_at_a_time": 1.0, "vs_plain_one_at_a_time": 1.0,
                                     "tau": 1.0, "same_as_alone": True},
                               "4": {"tokens_per_s": 290.0, "vs_one_at_a_time": 2.9, "vs_plain_one_at_a_time": 2.9,
                                     "tau": 1.0, "same_as_alone": True}}},
            "first_token": {"ar": {"idle_s": 0.05, "loaded_s": 0.08, "running": 3, "ratio": 1.6}}}
    engines = {"int8_activations": True, "methods": {
        "ar": {"all": {"tokens_per_s": 150.0, "decode_tokens_per_s": 160.0, "greedy_match": 1.0}},
        "eagle3": {"all": {"tokens_per_s": 180.0, "decode_tokens_per_s": 200.0, "greedy_match": 1.0,
                           "acceptance": 0.61}},
        "llamacpp": {"all": {"tokens_per_s": 120.0, "decode_tokens_per_s": 125.0, "greedy_match": 0.5}},
        "llamacpp-eagle3": {"all": {"tokens_per_s": 156.0, "decode_tokens_per_s": 162.5, "greedy_match": 0.5,
                                    "llamacpp_match": 1.0, "acceptance": 0.58}}}}
    (tmp_path / "docs/results/data/engines.json").write_text(json.dumps(engines))
    (tmp_path / "docs/results/data/conc.json").write_text(json.dumps(conc))
    (tmp_path / "docs/results/data/cost.json").write_text(json.dumps(cost))
    (tmp_path / "docs/results/data/bench.json").write_text(json.dumps(bench))
    sources = [{"id": "plain-decoding", "kind": "plain-decoding", "title": "Plain decoding", "machine": "Test CPU",
                "runs": [{"model": "m-1.5b", "file": "docs/results/data/cost.json", "command": "jakiro bench-cost x"}]},
               {"id": "methods", "kind": "methods", "title": "Methods", "machine": "Test CPU",
                "runs": [{"model": "m", "file": "docs/results/data/bench.json", "command": "jakiro bench y"}]},
               {"id": "batching", "kind": "concurrency", "title": "Batching", "machine": "Test CPU",
                "runs": [{"model": "m", "file": "docs/results/data/conc.json", "command": "jakiro bench z"}]},
               {"id": "engines", "kind": "engines", "title": "Engines", "machine": "Test CPU",
                "runs": [{"model": "m", "file": "docs/results/data/engines.json", "command": "scripts/e.sh"}]}]
    (tmp_path / "docs/results/sources.json").write_text(json.dumps(sources))
    (tmp_path / "README.md").write_text(readme)


def test_tables_are_written_between_the_markers_from_the_json(tmp_path):
    readme = ("intro\n<!-- results:plain-decoding -->\nold table\n<!-- /results:plain-decoding -->\nmiddle\n"
              "<!-- results:methods -->\n<!-- /results:methods -->\nend\n"
              "<!-- results:batching -->\n<!-- /results:batching -->\n<!-- results:engines -->\n<!-- /results:engines -->\n")
    _tree(tmp_path, readme)
    results.generate(str(tmp_path))
    out = (tmp_path / "README.md").read_text()
    assert out.startswith("intro\n<!-- results:plain-decoding -->\n| model |") and "old table" not in out
    assert "| m-1.5b | int8 | 22.1 | 12.0 | 1.84× | 3.8× | 0.96× | 1.37× |" in out
    assert "| m | float32-accurate | pld | 115.1 | 1.27× | 1.70 | 100% |" in out
    assert "| m | float32-accurate | llamacpp | 38.6 | 0.43× | - | 14% |" in out
    assert "Test CPU. Produced by:" in out and "jakiro bench-cost x" in out
    assert "\nmiddle\n" in out and "<!-- /results:methods -->\nend\n" in out
    assert "| m | int8 | ar | 4 | 290.0 | 2.90× | 2.90× | 1.00 | yes |" in out
    assert "| m | int8 | ar | 50 ms | 80 ms (3 running) | 1.60× |" in out
    assert "| m | int8 | ar | 150.0 | 1.00× | - | - |" in out
    assert "| m | int8 | eagle3 | 180.0 | 1.25× | 0.61 | 100% |" in out
    assert "| m | int8 | llamacpp | 120.0 | 1.00× | - | - |" in out
    assert "| m | int8 | llamacpp-eagle3 | 156.0 | 1.30× | 0.58 | 100% |" in out
    page = (tmp_path / "docs/results/README.md").read_text()
    assert "## Plain decoding" in page and "## Methods" in page and "jakiro bench y" in page
    results.generate(str(tmp_path))  # idempotent
    assert (tmp_path / "README.md").read_text() == out


def test_the_repositorys_results_page_is_what_its_data_gives(tmp_path):
    root = results.ROOT
    for name in ("README.md", "docs/results"):
        src = os.path.join(root, name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, tmp_path / name)
    results.generate(str(tmp_path))
    for name in ("README.md", "docs/results/README.md"):
        with open(os.path.join(root, name)) as f:
            assert (tmp_path / name).read_text() == f.read(), f"{name} is stale: run python -m jakiro.bench.results"
