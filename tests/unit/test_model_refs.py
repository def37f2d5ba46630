"""Model references and the choice of files, pure: no registry."""

from __future__ import annotations

import pytest

from haru.core.model_errors import BadReference
from haru.core.refs import DEFAULT_QUANTS, gguf_choice, is_reference, parse_reference, quant_of, safetensors_package


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("qwen3:0.6b", "ollama:library/qwen3:0.6b"),
        ("library/qwen3:0.6b", "ollama:library/qwen3:0.6b"),
        ("ollama:qwen3", "ollama:library/qwen3:latest"),
        ("ollama:someone/model:q4", "ollama:someone/model:q4"),
        ("registry.example.com/ns/model:7b", "ollama:registry.example.com/ns/model:7b"),
        ("hf:Qwen/Qwen3-0.6B-GGUF", "hf:Qwen/Qwen3-0.6B-GGUF"),
        ("hf:Qwen/Qwen3-0.6B-GGUF:q8_0", "hf:Qwen/Qwen3-0.6B-GGUF:Q8_0"),
        ("hf:Qwen/Qwen3-0.6B@0123abc", "hf:Qwen/Qwen3-0.6B@0123abc"),
        ("hf.co/unsloth/Qwen3-0.6B-GGUF:Q4_K_M", "hf:unsloth/Qwen3-0.6B-GGUF:Q4_K_M"),
    ],
)
def test_every_form_parses_to_its_canonical_reference(text, canonical):
    assert str(parse_reference(text)) == canonical
    assert is_reference(text)


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "empty model reference"),
        ("hf:Qwen", "a Hugging Face repository is ORG/REPO"),
        ("hf:a/b@", "the revision after '@' is empty"),
        ("Qwen3:0.6B", "not a model reference"),
        ("a/b/c/d:1", "not a model reference"),
    ],
)
def test_bad_references_say_what_works(text, says):
    with pytest.raises(BadReference, match=says):
        parse_reference(text)


@pytest.mark.parametrize("path", ["/models/x.gguf", "./x.gguf", "~/m", "x.gguf", "dir/model.safetensors", "."])
def test_paths_are_not_references(path):
    assert not is_reference(path)


def test_quant_in_file_names():
    assert quant_of("Qwen3-0.6B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("qwen3-0.6b-q8_0.gguf") == "Q8_0"
    assert quant_of("Llama-3-70B-IQ4_XS-00001-of-00002.gguf") == "IQ4_XS"
    assert quant_of("model-bf16.gguf") == "BF16"
    assert quant_of("model.gguf") == ""


def test_gguf_choice_prefers_in_order_keeps_shards_and_skips_projectors():
    files = [
        "a-Q8_0.gguf",
        "a-Q5_K_M-00002-of-00002.gguf",
        "a-Q5_K_M-00001-of-00002.gguf",
        "mmproj-a-F16.gguf",
        "README.md",
    ]
    assert gguf_choice(files, "", DEFAULT_QUANTS) == (
        "Q5_K_M",
        ["a-Q5_K_M-00001-of-00002.gguf", "a-Q5_K_M-00002-of-00002.gguf"],
    )
    assert gguf_choice(files, "q8_0", DEFAULT_QUANTS) == ("Q8_0", ["a-Q8_0.gguf"])
    assert gguf_choice(["README.md", "config.json"], "", DEFAULT_QUANTS) == ("", [])
    with pytest.raises(BadReference, match="no Q2_K GGUF in this repository; it has Q5_K_M, Q8_0"):
        gguf_choice(files, "Q2_K", DEFAULT_QUANTS)


def test_safetensors_package_is_the_top_level_model_files():
    files = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "original/consolidated.safetensors",
        "README.md",
        ".gitattributes",
    ]
    assert safetensors_package(files) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    assert safetensors_package(["model.safetensors"]) == []  # no config.json: not a package vLLM can load


def test_a_layout_pulls_only_prefixed_references():
    from haru.agents.pulling import needs_pull

    assert needs_pull("hf:Qwen/Qwen3-0.6B-GGUF", "llama_server") and needs_pull("ollama:qwen3:0.6b", "llama_server")
    assert not needs_pull("Qwen/Qwen3-0.6B", "vllm")  # an id vLLM fetches itself
    assert not needs_pull("sim/m1", "vllm") and not needs_pull("/models/x.gguf", "llama_server")
    assert not needs_pull("hf:a/b", "external")


def test_the_progress_bar_shows_bytes_rate_and_eta_on_a_terminal_only():
    import io

    from haru.models.pull import Progress

    out = io.StringIO()
    bar = Progress(10 << 20, label="model.gguf", stream=out, enabled=True)
    bar.advance(5 << 20)
    bar.close()
    text = out.getvalue()
    assert text.startswith("\rmodel.gguf") and "50.0%" in text and "5.0 MiB/10.0 MiB" in text
    assert "/s ETA " in text and text.endswith("\n")
    quiet = io.StringIO()  # not a terminal: nothing at all
    bar = Progress(10, label="x", stream=quiet)
    bar.advance(10)
    bar.close()
    assert quiet.getvalue() == ""


def test_serve_model_flags():
    from haru.core.sizes import GiB
    from haru.up.serve import ServeError, parse_model_flag

    f = parse_model_flag("chat=hf:Qwen/Qwen3-0.6B-GGUF:Q8_0:2.5@8192")
    assert (f.name, f.source, f.vram_bytes, f.context, f.format) == (
        "chat",
        "hf:Qwen/Qwen3-0.6B-GGUF:Q8_0",
        int(2.5 * GiB),
        8192,
        "",
    )
    g = parse_model_flag("big=gguf:/models/big.gguf:20GiB")
    assert (g.source, g.format, g.vram_bytes, g.context) == ("/models/big.gguf", "gguf", 20 * GiB, 0)
    assert parse_model_flag("q=qwen3:0.6b:1").source == "qwen3:0.6b" and parse_model_flag("q=qwen3:0.6b:1").is_reference
    for bad, says in (
        ("x", "NAME="),
        ("x=/m.gguf", "no VRAM size"),
        ("x=/m.gguf:lots", "not a VRAM size"),
        ("x=/m.gguf:1@big", "not a context length"),
        ("x=/m.gguf:0", "more than 0"),
    ):
        with pytest.raises(ServeError, match=says):
            parse_model_flag(bad)
