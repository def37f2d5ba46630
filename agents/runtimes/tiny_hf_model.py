"""A tiny Hugging Face llama model in safetensors, with a sentencepiece tokenizer: for `haru convert`'s
tests, the real vLLM tests and `haru up --demo --real vllm`.

    <a python with sentencepiece, numpy, safetensors> agents/runtimes/tiny_hf_model.py OUT_DIR [--seed N]

A plain script (it imports nothing of Haru), run by the converter's or vLLM's managed interpreter.

Run by the converter's own Python (the managed venv: it has sentencepiece, numpy and safetensors): the
tokenizer is trained here on generated text, the weights are seeded random. byte fallback (every text tokenizes),
256-wide, 2 blocks, so every tensor row is a multiple of 256 (k-quants need that). The text it would generate is
noise; what is real is that llama.cpp's converter and quantizer accept it and llama-server serves the result.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HIDDEN, FF, LAYERS, HEADS = 256, 512, 2, 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import numpy as np
    import sentencepiece as spm  # type: ignore[import-not-found]  # the managed venv has it, not this one
    from safetensors.numpy import save_file  # type: ignore[import-not-found]

    rnd = random.Random(args.seed)
    words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 7))) for _ in range(300)]
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(3000)))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(out / "tokenizer"),
        vocab_size=512,
        byte_fallback=True,
        model_type="bpe",
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    corpus.unlink()
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    vocab = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model")).vocab_size()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FF,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
            }
        )
    )
    g = np.random.default_rng(args.seed)

    def w(*shape):
        return (g.standard_normal(shape) * 0.02).astype(np.float32)

    t = {
        "model.embed_tokens.weight": w(vocab, HIDDEN),
        "model.norm.weight": np.ones(HIDDEN, np.float32),
        "lm_head.weight": w(vocab, HIDDEN),
    }
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        t[pre + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        t[pre + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[pre + f"self_attn.{proj}.weight"] = w(HIDDEN, HIDDEN)
        t[pre + "mlp.gate_proj.weight"] = w(FF, HIDDEN)
        t[pre + "mlp.up_proj.weight"] = w(FF, HIDDEN)
        t[pre + "mlp.down_proj.weight"] = w(HIDDEN, FF)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(out)


if __name__ == "__main__":
    main()
