"""`qkv train`: the paper's recipe scaled down to two CPU cores.

Adam (beta2 0.98, eps 1e-9), linear warm-up then inverse-square-root decay (Section 5.3, with
the decay start as a knob so a short run does not decay too early) and an optional linear
cool-down at the end, label smoothing, dropout, token-bucketed batches. Checkpoints `last.pt`
every few minutes and `best.pt` on dev WER; `--resume` carries on from `last.pt` exactly where it
stopped: the model, the optimiser, the schedule, the batch within the epoch's fixed order, and the
random states (dropout), so an interrupted run ends with the weights an uninterrupted one would.
The run directory (`--out`) also holds `config.json` (the recipe) and `history.jsonl` (one line of
dev figures per epoch). `--device cuda` trains on a GPU (bf16 autocast there too); the CPU is the
default.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from export import data
from export.checkpoint import TorchStepModel
from export.model import TransformerConfig, make_model
from export.scoring import score
from service.generation import greedy_decode

__all__ = ["TrainConfig", "main", "train"]


@dataclass
class TrainConfig:
    out: str = "checkpoints/g2p"
    d_model: int = 192
    h: int = 4
    n_encoder: int = 3
    n_decoder: int = 3
    d_ff: int = 768
    dropout: float = 0.1
    max_tokens: int = 1600  # padded tokens per batch (rows x longest); smaller = more updates, same tokens/s here
    lr: float = 1e-3  # peak learning rate
    warmup: int = 1000  # steps of linear warm-up
    decay_start: int = 8000  # inverse-sqrt decay from here: lr = peak * sqrt(decay_start / step)
    cooldown_from: int = 0  # step where a linear cool-down to 2 % of the rate begins (0: none)
    cooldown_steps: int = 0  # its length in steps
    label_smoothing: float = 0.1
    bf16: bool = True  # bfloat16 autocast: about 2x the tokens/s on AVX-512 BF16 CPUs, weights stay fp32
    epochs: int = 60
    hours: float = 0.0  # stop after this much training time (0: no limit)
    threads: int = 2
    seed: int = 1
    dev_words: int = 2000  # dev subset decoded after each epoch
    train_words: int = 0  # use only the first N training words (0: all); for smoke tests
    checkpoint_minutes: float = 5.0
    steps: int = 0  # stop after this many steps in all, with a checkpoint (0: no limit); resume carries on
    device: str = "cpu"  # or cuda


def learning_rate(step: int, c: TrainConfig) -> float:
    warm = min(1.0, step / max(1, c.warmup))
    decay = math.sqrt(c.decay_start / max(step, c.decay_start))
    cool = 1.0
    if c.cooldown_steps and step > c.cooldown_from:
        cool = max(0.02, 1 - (step - c.cooldown_from) / c.cooldown_steps)
    return c.lr * warm * decay * cool


def dev_wer(
    model: nn.Module, lexicon: data.Lexicon, words: list[str], graphemes: Any, phonemes: Any
) -> dict[str, float]:
    model.eval()
    on_cpu = model if next(model.parameters()).device.type == "cpu" else copy.deepcopy(model).cpu()
    hyps = greedy_decode(TorchStepModel(on_cpu), [graphemes.encode(w) for w in words], max_len=40, batch_size=500)  # type: ignore[arg-type]
    model.train()
    return score([phonemes.decode(h.output) for h in hyps], [lexicon[w] for w in words])


def train(c: TrainConfig, resume: bool = False) -> Path:
    torch.set_num_threads(c.threads)
    torch.manual_seed(c.seed)
    random.seed(c.seed)
    device = torch.device(c.device)
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(c), indent=2) + "\n")
    lexicon = data.load_lexicon()
    if not (data.SPLIT_DIR / "train.txt").exists():
        data.make_split(lexicon)
    train_words = data.read_split("train")
    if c.train_words:
        train_words = train_words[: c.train_words]
    dev_words = random.Random(0).sample(data.read_split("dev"), min(c.dev_words, len(data.read_split("dev"))))
    graphemes, phonemes = data.build_vocabularies(lexicon, data.read_split("train"))
    examples = data.examples(lexicon, train_words, graphemes, phonemes)

    config = TransformerConfig(
        src_vocab=len(graphemes),
        tgt_vocab=len(phonemes),
        d_model=c.d_model,
        h=c.h,
        n_encoder=c.n_encoder,
        n_decoder=c.n_decoder,
        d_ff=c.d_ff,
        dropout=c.dropout,
    )
    model = make_model(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=c.lr, betas=(0.9, 0.98), eps=1e-9)
    loss_fn = nn.CrossEntropyLoss(ignore_index=config.pad_id, label_smoothing=c.label_smoothing)
    step, epoch, elapsed, best = 0, 0, 0.0, 1.0
    done_in_epoch, tokens, loss_sum = 0, 0.0, 0.0  # batches of the current epoch already trained on
    history: list[dict[str, float]] = []
    last = out / "last.pt"
    if resume and last.exists():
        state = torch.load(last, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, elapsed = state["step"], state["epoch"], state["elapsed_s"]
        best, history = state["best_dev_wer"], state["history"]
        done_in_epoch, tokens, loss_sum = state.get("position", (0, 0.0, 0.0))
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
            if device.type == "cuda" and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(state["rng"]["cuda"])
        print(
            f"resumed from {last}: epoch {epoch + 1} batch {done_in_epoch}, step {step}, {elapsed / 3600:.2f} h, "
            f"best dev WER {best:.3f}"
        )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters, {len(examples)} training pairs, {config}", flush=True)

    def save(path: Path, elapsed_s: float) -> None:
        torch.save(
            {
                "config": config.to_dict(),
                "train": asdict(c),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "epoch": epoch,
                "elapsed_s": elapsed_s,
                "best_dev_wer": best,
                "history": history,
                "position": (done_in_epoch, tokens, loss_sum),
                "rng": {
                    "torch": torch.get_rng_state(),
                    "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
                },
                "parameters": n_params,
                "graphemes": graphemes.symbols,
                "phonemes": phonemes.symbols,
            },
            path.with_suffix(".tmp"),
        )
        path.with_suffix(".tmp").replace(path)  # atomic: a killed run never leaves half a file

    model.train()
    last_save = time.monotonic()
    while epoch < c.epochs and not (c.hours and elapsed >= c.hours * 3600):
        # Each epoch's order is fixed by the seed and the epoch: a resumed run skips what it has done.
        batches = list(data.token_batches(examples, c.max_tokens, random.Random(c.seed * 1000 + epoch)))
        t0 = time.monotonic()
        for i in range(done_in_epoch, len(batches)):
            src, tgt = batches[i]
            src_t, tgt_t = torch.from_numpy(src).to(device), torch.from_numpy(tgt).to(device)
            for g in optimizer.param_groups:
                g["lr"] = learning_rate(step + 1, c)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=c.bf16):
                logits = model(src_t, tgt_t[:, :-1])  # teacher forcing: predict token t+1 from tokens <= t
            loss = loss_fn(logits.float().reshape(-1, logits.size(-1)), tgt_t[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            done_in_epoch = i + 1
            n_tok = int((tgt_t[:, 1:] != 0).sum() + (src_t != 0).sum())
            tokens += n_tok
            loss_sum += float(loss.detach()) * n_tok
            if i % 20 == 0 or i == len(batches) - 1:
                spent = time.monotonic() - t0
                rate = tokens / max(spent, 1e-9)
                eta = spent / (i + 1) * (len(batches) - i - 1)
                sys.stdout.write(
                    f"\repoch {epoch + 1} {i + 1}/{len(batches)} loss {loss_sum / tokens:.3f} "
                    f"lr {learning_rate(step, c):.2e} {rate:,.0f} tok/s ETA {eta / 60:.1f} min   "
                )
                sys.stdout.flush()
            if time.monotonic() - last_save > c.checkpoint_minutes * 60:
                save(last, elapsed + time.monotonic() - t0)
                last_save = time.monotonic()
            if c.steps and step >= c.steps and done_in_epoch < len(batches):
                save(last, elapsed + time.monotonic() - t0)
                print(f"\nstopped at step {step} (--steps); --resume carries on", flush=True)
                return out / "best.pt"
        elapsed += time.monotonic() - t0
        epoch += 1
        epoch_loss = loss_sum / max(tokens, 1)
        done_in_epoch, tokens, loss_sum = 0, 0.0, 0.0
        result = dev_wer(model, lexicon, dev_words, graphemes, phonemes)
        result.update(epoch=epoch, step=step, hours=elapsed / 3600, loss=epoch_loss)
        history.append(result)
        with (out / "history.jsonl").open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(
            f"\nepoch {epoch}: dev WER {result['wer']:.3f} ({result['wer_stress_free']:.3f} stress-free) "
            f"PER {result['per']:.3f} ({result['per_stress_free']:.3f}), {elapsed / 3600:.2f} h",
            flush=True,
        )
        if result["wer"] < best or not (out / "best.pt").exists():
            best = min(best, result["wer"])
            save(out / "best.pt", elapsed)
        save(last, elapsed)
        last_save = time.monotonic()
        if c.steps and step >= c.steps:
            break
    return out / "best.pt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qkv train", description=__doc__)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    parser.add_argument("--resume", action="store_true", help="carry on from OUT/last.pt")
    args = vars(parser.parse_args(argv))
    resume = args.pop("resume")
    best = train(TrainConfig(**args), resume=resume)
    print(f"best checkpoint: {best}")
    return 0
