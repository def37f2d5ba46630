"""A tiny llama-architecture GGUF, written here, so a real llama-server runs with nothing downloaded.

    python -m haru.agents.runtimes.tiny_model OUT.gguf [--seed N]

~600 KB: vocabulary 512 (3 control tokens, 256 byte tokens `<0xNN>`, then `▁word` tokens), 64-wide
embeddings, 2 blocks of 4 heads, feed-forward 128, F32, a ChatML chat template. The weights are random
but seeded, so a file is the same bytes for the same seed and a request with `temperature: 0` gets
the same answer every time. The text it generates is noise; the protocol around it (loading,
`/health`, chat JSON and SSE, errors) is llama-server's own. Used by the tests, `haru up --demo
--real` and `bench/runtime.py`. Needs the `gguf` package (`pip install -e '.[real]'`).
"""

from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

__all__ = ["write_tiny_model", "corrupt_copy", "CHAT_TEMPLATE"]

VOCAB = 512
EMBED = 64
BLOCKS = 2
HEADS = 4
FEED_FORWARD = 128
CONTEXT = 2048

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] "
    "+ '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by "
    "hot word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again animal point "
    "mother world near build self earth father head stand own page should country found answer school grow "
    "study still learn plant cover food sun four between state keep eye never last let thought city tree "
    "cross farm hard start might story saw far sea draw left late run while press close night real life few "
    "north open seem together next white children begin got walk example ease paper group always music those "
    "both mark often letter until mile river car feet care second book carry took science eat room friend "
    "began idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl"
).split()


def _vocabulary() -> tuple[list[bytes], list[float], list[int]]:
    from gguf import TokenType

    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>".encode())
        types.append(TokenType.BYTE)
        scores.append(0.0)
    words = ["\u2581" + w for w in dict.fromkeys(_WORDS)] + ["\u2581" + c for c in string.ascii_lowercase]
    for i, w in enumerate(words[: VOCAB - len(tokens)]):
        tokens.append(w.encode())
        types.append(TokenType.NORMAL)
        scores.append(-float(i))
    while len(tokens) < VOCAB:  # (the word list is long enough; this keeps the size exact regardless)
        tokens.append(f"\u2581w{len(tokens)}".encode())
        types.append(TokenType.NORMAL)
        scores.append(-float(len(tokens)))
    return tokens, scores, [int(t) for t in types]


def write_tiny_model(path: Path | str, *, seed: int = 0, name: str = "haru-tiny") -> Path:
    """Write the tiny model to `path` (atomically: a temporary file, then renamed). Returns the path."""
    try:
        import numpy as np
        from gguf import GGUFWriter, LlamaFileType
    except ImportError as exc:  # pragma: no cover - the extra is installed for tests and the real demo
        raise RuntimeError(
            f"writing a tiny GGUF needs the `gguf` package ({exc}); install it with `pip install -e '.[real]'`"
        ) from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    rng = np.random.RandomState(seed)

    def weights(*shape: int) -> np.ndarray:  # numpy shapes are ggml's reversed
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    ones = np.ones(EMBED, dtype=np.float32)
    w = GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(EMBED)
    w.add_block_count(BLOCKS)
    w.add_feed_forward_length(FEED_FORWARD)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(EMBED // HEADS)
    w.add_file_type(LlamaFileType.ALL_F32)
    tokens, scores, types = _vocabulary()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", weights(VOCAB, EMBED))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", weights(VOCAB, EMBED))
    for i in range(BLOCKS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for part in ("q", "k", "v", "output"):
            w.add_tensor(f"blk.{i}.attn_{part}.weight", weights(EMBED, EMBED))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weights(FEED_FORWARD, EMBED))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weights(FEED_FORWARD, EMBED))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weights(EMBED, FEED_FORWARD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def corrupt_copy(good: Path | str, bad: Path | str, *, keep: float = 0.5) -> Path:
    """A truncated copy of a GGUF (its first `keep` fraction): what an interrupted download leaves."""
    data = Path(good).read_bytes()
    Path(bad).write_bytes(data[: int(len(data) * keep)])
    return Path(bad)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m haru.agents.runtimes.tiny_model", description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="haru-tiny")
    args = p.parse_args(argv)
    out = write_tiny_model(args.out, seed=args.seed, name=args.name)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
