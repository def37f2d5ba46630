#!/usr/bin/env python3
"""An example LoRA trainer that keeps Haru's training contract. Copy it and change the model and the data.

    python train_lora.py --base MODEL_DIR --base-model NAME --adapter NAME --data data.jsonl \
        [--steps 200] [--checkpoint-every 20] [--rank 8] [--batch 4] [--lr 1e-3] [--seed 0] [--dtype bfloat16]

The contract (the agent adds exactly these to the environment of the slot's command):

    HARU_GPU_INDEX       the GPU to train on, in NVML's order (CUDA_DEVICE_ORDER=PCI_BUS_ID is set beside it):
                         the trainer sets CUDA_VISIBLE_DEVICES to it before torch starts, so it sees that
                         card alone; without a GPU (or a CUDA torch) it trains on the CPU
    HARU_CHECKPOINT_DIR  where it checkpoints, and what it resumes from when it starts again

What it writes there:

    checkpoints/<name>/  one complete checkpoint: the LoRA weights (adapter_model.safetensors,
                         adapter_config.json), the optimizer (optimizer.pt) and state.json (the run, the step)
    latest               the name of the newest complete checkpoint; replaced by a rename, never rewritten
    adapter/             when the run finishes: the adapter (PEFT save_pretrained)
    publish.json         then: the manifest the agent publishes the adapter from; then `latest` and the
                         checkpoints are removed (the run is over: the next start begins a new one)

While publish.json is there (a finished run the agent has not published yet) the trainer does nothing and
exits 0, so the agent publishes it; the agent moves it to published/ once the adapter is in the store.

A checkpoint is written to checkpoints/.tmp-<name>/, every file fsynced, renamed into place, and only
then named by `latest` (itself written to a temporary file, fsynced and renamed): SIGKILL at any moment
leaves the previous checkpoint whole, and a failover loses at most the steps since it. SIGTERM makes it
finish the step, checkpoint and exit 0. The steps are deterministic in (seed, step), so a resumed run
trains on the same batches it would have.

data.jsonl: one {"prompt": ..., "answer": ...} a line. Every fifth example (the 5th, the 10th, ...) is
held out: never trained on, its loss is the `held_out_loss` metric the publish manifest carries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

CHECKPOINTS = "checkpoints"
LATEST = "latest"
ADAPTER = "adapter"
MANIFEST = "publish.json"
HELD_OUT_EVERY = 5


def say(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------- files


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def write_atomic(path: Path, text: str) -> None:
    """`text` at `path`, whole or not at all: a temporary file, fsynced, renamed, the folder fsynced."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def read_data(path: Path) -> list[dict]:
    examples = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SystemExit(f"{path}:{n}: not JSON ({exc}); each line is {{'prompt': ..., 'answer': ...}}") from exc
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("prompt"), str)
            or not isinstance(row.get("answer"), str)
        ):
            raise SystemExit(f"{path}:{n}: needs string fields 'prompt' and 'answer'")
        examples.append(row)
    if len(examples) < HELD_OUT_EVERY:
        raise SystemExit(f"{path}: {len(examples)} examples; give at least {HELD_OUT_EVERY} (every fifth is held out)")
    return examples


# ------------------------------------------------------------------------------------- checkpoints


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names (None: none yet). Half-written ones (.tmp-*) are swept."""
    ckpts = root / CHECKPOINTS
    if ckpts.is_dir():
        for stale in ckpts.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    path = ckpts / name
    if not (path / "state.json").is_file():
        raise SystemExit(f"{root / LATEST} names {name!r}, which is not a complete checkpoint in {ckpts}")
    return path


def save_checkpoint(root: Path, model, optimizer, state: dict) -> Path:
    """Write the checkpoint whole under a temporary name, rename it into place, then point `latest` at it;
    the previous one is kept (a reader that already chose it still finds it), older ones are removed."""
    import torch

    ckpts = root / CHECKPOINTS
    ckpts.mkdir(parents=True, exist_ok=True)
    name = f"step-{state['step']:08d}-{state['run']}"
    tmp = ckpts / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    fsync_tree(tmp)
    final = ckpts / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(ckpts)
    write_atomic(root / LATEST, name + "\n")
    previous = state.get("previous", "")
    for old in ckpts.iterdir():
        if not old.name.startswith(".") and old.name not in (name, previous):
            shutil.rmtree(old, ignore_errors=True)
    state["previous"] = name
    return final


# ---------------------------------------------------------------------------------------- training


def pin_gpu() -> None:
    """CUDA_VISIBLE_DEVICES=$HARU_GPU_INDEX before torch starts: this process sees the slot's card alone."""
    index = os.environ.get("HARU_GPU_INDEX")
    if index:
        os.environ["CUDA_VISIBLE_DEVICES"] = index


def encode(tokenizer, prompt: str, answer: str, max_len: int) -> tuple[list[int], list[int]]:
    """Input ids and labels: the answer's tokens are learned, the prompt's are not (label -100)."""
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    a = tokenizer(" " + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (p + a)[:max_len]
    labels = ([-100] * len(p) + a)[:max_len]
    return ids, labels


def batch_of(tokenizer, rows: list[dict], max_len: int, device):
    import torch

    encoded = [encode(tokenizer, r["prompt"], r["answer"], max_len) for r in rows]
    width = max(len(ids) for ids, _ in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(encoded):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return ids.to(device), labels.to(device), mask.to(device)


def held_out_loss(model, tokenizer, rows: list[dict], max_len: int, device) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        ids, labels, mask = batch_of(tokenizer, rows, max_len, device)
        loss = float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    model.train()
    return loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the base model's directory (Hugging Face safetensors)")
    p.add_argument("--base-model", required=True, help="the fleet's declared model id it serves under")
    p.add_argument("--adapter", required=True, help="the adapter's name: served as <base-model>:<adapter>")
    p.add_argument("--data", required=True, help="a jsonl file of {'prompt', 'answer'}")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the base's weights")
    args = p.parse_args(argv)

    root = Path(os.environ.get("HARU_CHECKPOINT_DIR") or "")
    if not os.environ.get("HARU_CHECKPOINT_DIR"):
        raise SystemExit("HARU_CHECKPOINT_DIR is not set: the agent sets it from the training slot's checkpoint_dir")
    root.mkdir(parents=True, exist_ok=True)

    # SIGTERM: finish the step, checkpoint, exit 0. Before the first step there is nothing to keep.
    stop = {"asked": False, "training": False}

    def on_term(signum, frame):
        if not stop["training"]:
            os._exit(0)
        stop["asked"] = True

    signal.signal(signal.SIGTERM, on_term)

    if (root / MANIFEST).exists():
        say(f"{root / MANIFEST} is a finished run not yet published: exiting for the agent to publish it")
        return 0
    data_path = Path(args.data)
    data_digest = sha256_file(data_path)
    rows = read_data(data_path)
    held = [r for i, r in enumerate(rows, 1) if i % HELD_OUT_EVERY == 0]
    train = [r for i, r in enumerate(rows, 1) if i % HELD_OUT_EVERY != 0]

    pin_gpu()
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    # the fast tokenizer where the model ships one (tokenizer.json), else the sentencepiece one as it is
    tokenizer = AutoTokenizer.from_pretrained(args.base, use_fast=(Path(args.base) / "tokenizer.json").exists())
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, args.dtype)).to(device)

    ckpt = latest_checkpoint(root)
    if ckpt is not None:
        state = json.loads((ckpt / "state.json").read_text())
        state["previous"] = ckpt.name
        if state.get("data_digest") != data_digest or state.get("adapter") != args.adapter:
            say(f"checkpoint {ckpt.name} is of other data or another adapter: starting a new run")
            ckpt = None
    if ckpt is not None:
        model = PeftModel.from_pretrained(base, ckpt, is_trainable=True)
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr)
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=device))
        say(f"resumed from {ckpt.name} at step {state['step']} (run {state['run']})")
    else:
        lora = LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            lora_dropout=0.0,
            target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lora)
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr)
        state = {
            "run": time.strftime("%Y%m%d%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6],
            "step": 0,
            "adapter": args.adapter,
            "data_digest": data_digest,
            "losses": [],
        }
        say(f"new run {state['run']}")
    model.train()
    where = f"GPU {os.environ.get('HARU_GPU_INDEX', '?')}" if device.type == "cuda" else "the CPU"
    say(
        f"training on {where} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}): {len(train)} "
        f"examples, {len(held)} held out, steps {state['step']}..{args.steps}"
    )

    stop["training"] = True
    while state["step"] < args.steps and not stop["asked"]:
        step = state["step"] + 1
        pick = random.Random(f"{args.seed}:{step}")  # the batch is a function of (seed, step): resumable
        ids, labels, mask = batch_of(tokenizer, pick.sample(train, min(args.batch, len(train))), args.max_len, device)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step
        state["losses"] = (state["losses"] + [float(loss)])[-20:]
        say(f"step {step} loss {float(loss):.4f}")
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_checkpoint(root, model, optimizer, state)
            say(f"checkpoint step {step}")
    if stop["asked"]:
        if state["step"] % args.checkpoint_every != 0:
            save_checkpoint(root, model, optimizer, state)
        say(f"stopped by SIGTERM at step {state['step']}, checkpointed")
        return 0

    # Finished: the adapter, then the manifest the agent publishes from (written last, atomically).
    adapter_tmp = root / f".tmp-{ADAPTER}"
    shutil.rmtree(adapter_tmp, ignore_errors=True)
    model.save_pretrained(adapter_tmp)
    fsync_tree(adapter_tmp)
    shutil.rmtree(root / ADAPTER, ignore_errors=True)
    os.replace(adapter_tmp, root / ADAPTER)
    fsync_dir(root)
    losses = state["losses"]
    manifest = {
        "base_model": args.base_model,
        "adapter": args.adapter,
        "version": state["run"],
        "adapter_dir": ADAPTER,
        "rank": args.rank,
        "data": str(data_path),
        "data_digest": data_digest,
        "metrics": {
            "steps": float(state["step"]),
            "loss": sum(losses[-5:]) / max(1, len(losses[-5:])),
            "held_out_loss": held_out_loss(model, tokenizer, held, args.max_len, device),
        },
    }
    write_atomic(root / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    (root / LATEST).unlink(missing_ok=True)
    fsync_dir(root)
    shutil.rmtree(root / CHECKPOINTS, ignore_errors=True)
    say(f"finished run {state['run']} at step {state['step']}: {json.dumps(manifest['metrics'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
