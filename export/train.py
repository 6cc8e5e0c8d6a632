"""`qkv train`: the paper's recipe, on two CPU cores by default or on a GPU.

Adam (beta2 0.98, eps 1e-9), linear warm-up then inverse-square-root decay (Section 5.3, with
the decay start as a knob so a short run does not decay too early) and an optional linear
cool-down at the end, label smoothing, dropout, token-bucketed batches. Checkpoints `last.pt`
every few minutes and `best.pt` on dev WER; `--resume` carries on from `last.pt` exactly where it
stopped: the model, the optimiser, the schedule, the batch within the epoch's fixed order, and the
random states (dropout), so an interrupted run ends with the weights an uninterrupted one would.
The run directory (`--out`) also holds `config.json` (the recipe) and `history.jsonl` (one line of
dev figures per evaluated epoch). `--device cuda` trains on a GPU (bf16 autocast there too).

More levers, each optional:
- `--keep-epochs K` keeps the last K epochs' weights and writes their mean as `averaged.pt`.
- `--init CKPT` starts from another run's weights with a fresh optimiser and schedule (a warm
  restart); the checkpoints list the runs they continue, and so does the exported model card.
- `--teachers A.pt,B.pt,...` distils an ensemble into the model being trained (token-level, as
  Kim & Rush 2016, and Sun et al. 2019 for G2P): the loss mixes the gold targets with the
  teachers' mean distribution at every target position.
- `--hours H --cooldown-minutes M` makes the cool-down the last M minutes of an H-hour budget,
  for a run that must end on time; its schedule then follows the clock, so such a run resumes
  close to, not exactly, where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from export import data
from export.checkpoint import TorchStepModel, read_checkpoint
from export.model import TransformerConfig, make_model
from export.scoring import score
from service.decoding.words import greedy_decode
from service.errors import UsageError, in_range, readable_file

__all__ = ["TrainConfig", "check", "main", "train"]


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
    eval_every: int = 1  # decode the dev subset every N epochs (and after the last)
    keep_epochs: int = 0  # keep the last K epochs' weights (epoch-N.pt) and write their mean (averaged.pt)
    cooldown_minutes: float = 0.0  # with --hours: a linear cool-down over the budget's last M minutes
    teachers: str = ""  # comma-separated checkpoints whose mean distribution is distilled (same vocabularies)
    distill_weight: float = 0.5  # share of the loss from the teachers; the rest from the gold targets
    init: str = ""  # start from this checkpoint's weights (same architecture), with a fresh optimiser and schedule


def learning_rate(step: int, c: TrainConfig, seconds_left: float = math.inf) -> float:
    warm = min(1.0, step / max(1, c.warmup))
    decay = math.sqrt(c.decay_start / max(step, c.decay_start))
    cool = 1.0
    if c.cooldown_steps and step > c.cooldown_from:
        cool = max(0.02, 1 - (step - c.cooldown_from) / c.cooldown_steps)
    if c.hours and c.cooldown_minutes:
        cool = min(cool, max(0.02, seconds_left / (c.cooldown_minutes * 60)))
    return c.lr * warm * decay * cool


def hardware(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{threads} CPU threads ({platform.processor() or platform.machine()})"


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """One run of a checkpoint's history, as its model card lists it."""
    return {"run": state["train"]["out"], "hours": round(state["elapsed_s"] / 3600, 4), "epochs": state["epoch"],
            "steps": state["step"], "hardware": state.get("hardware"), "recipe": state["train"]}  # fmt: skip


class Teachers:
    """The mean next-token distribution of several trained models, for distillation (no gradients)."""

    def __init__(self, paths: list[Path], device: torch.device, phonemes: Any) -> None:
        from export.checkpoint import load_checkpoint

        self.models = []
        for path in paths:
            loaded = load_checkpoint(path)
            if loaded.phonemes.symbols != phonemes.symbols:
                raise ValueError(f"teacher {path}: its phoneme vocabulary differs from this run's")
            self.models.append(loaded.model.to(device).eval())

    @torch.no_grad()
    def distribution(self, src: torch.Tensor, tgt_in: torch.Tensor, bf16: bool) -> torch.Tensor:
        with torch.autocast(src.device.type, dtype=torch.bfloat16, enabled=bf16):
            return torch.stack([m(src, tgt_in).float().softmax(-1) for m in self.models]).mean(0)


def dev_wer(
    model: nn.Module, lexicon: data.Lexicon, words: list[str], graphemes: Any, phonemes: Any
) -> dict[str, float]:
    device = next(model.parameters()).device
    model.eval().cpu()  # decoded on the CPU; moved in place, so the optimiser keeps its parameters
    hyps = greedy_decode(TorchStepModel(model), [graphemes.encode(w) for w in words], max_len=40, batch_size=500)  # type: ignore[arg-type]
    model.to(device).train()
    return score([phonemes.decode(h.output) for h in hyps], [lexicon[w] for w in words])


def train(c: TrainConfig, resume: bool = False, clock: Callable[[], float] = time.monotonic) -> Path:
    """Train as `c` says; returns the checkpoint to use: `best.pt`, or `last.pt` when no dev evaluation
    has run yet (a run stopped by --steps within its first epoch). `clock` (seconds) times --hours, the
    cool-down and checkpoints; a test passes a simulated one, so that where a timed run stops does not
    depend on how fast the machine trains."""
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
    model = make_model(config)
    lineage: list[dict[str, Any]] = []  # the runs these weights come from, oldest first (with --init)
    if c.init:
        start = read_checkpoint(Path(c.init))
        model.load_state_dict(start["model"])
        lineage = [*start.get("lineage", []), stage(start)]
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=c.lr, betas=(0.9, 0.98), eps=1e-9, fused=device.type == "cuda")
    loss_fn = nn.CrossEntropyLoss(ignore_index=config.pad_id, label_smoothing=c.label_smoothing)
    teachers = Teachers([Path(p) for p in c.teachers.split(",")], device, phonemes) if c.teachers else None
    step, epoch, elapsed, best = 0, 0, 0.0, 1.0
    done_in_epoch, tokens, loss_sum = 0, 0.0, 0.0  # batches of the current epoch already trained on
    history: list[dict[str, float]] = []
    last = out / "last.pt"
    wrote_best = False  # whether this run (or the one it resumes) wrote best.pt: what it may report
    if resume and last.exists():
        state = read_checkpoint(last, map_location=device)
        wrote_best = (out / "best.pt").exists()
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
    machine = hardware(device, c.threads)
    print(f"{n_params / 1e6:.2f} M parameters, {len(examples)} training pairs, {config}", flush=True)

    def save(path: Path, elapsed_s: float, resumable: bool = True) -> None:
        """`resumable=False`: the weights and what describes them, without the optimiser (a third the size)."""
        save_atomically(
            {
                "config": config.to_dict(),
                "train": asdict(c),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict() if resumable else None,
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
                "hardware": machine,
                "lineage": lineage,
                "graphemes": graphemes.symbols,
                "phonemes": phonemes.symbols,
            },
            path,
        )

    model.train()
    last_save = clock()
    pending: list[torch.Tensor] = []  # this epoch's losses (x tokens) not yet added to loss_sum

    def settle() -> None:
        """Add the pending losses to loss_sum: one wait for a GPU every few steps, not every step."""
        nonlocal loss_sum
        if pending:
            loss_sum += float(torch.stack(pending).sum())
            pending.clear()

    budget = c.hours * 3600 if c.hours else math.inf
    out_of_time = elapsed >= budget
    while epoch < c.epochs and not out_of_time:
        # Each epoch's order is fixed by the seed and the epoch: a resumed run skips what it has done.
        batches = list(data.token_batches(examples, c.max_tokens, random.Random(c.seed * 1000 + epoch)))
        t0 = clock()
        for i in range(done_in_epoch, len(batches)):
            src, tgt = batches[i]
            src_t, tgt_t = torch.from_numpy(src).to(device), torch.from_numpy(tgt).to(device)
            lr = learning_rate(step + 1, c, budget - elapsed - (clock() - t0))
            for g in optimizer.param_groups:
                g["lr"] = lr
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=c.bf16):
                logits = model(src_t, tgt_t[:, :-1])  # teacher forcing: predict token t+1 from tokens <= t
            loss = loss_fn(logits.float().reshape(-1, logits.size(-1)), tgt_t[:, 1:].reshape(-1))
            if teachers:
                # Cross-entropy against the teachers' mean distribution, over the real target positions.
                soft = teachers.distribution(src_t, tgt_t[:, :-1], c.bf16)
                real = tgt_t[:, 1:] != config.pad_id
                distilled = -(soft * logits.float().log_softmax(-1)).sum(-1)[real].mean()
                loss = (1 - c.distill_weight) * loss + c.distill_weight * distilled
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            done_in_epoch = i + 1
            n_tok = np.count_nonzero(tgt[:, 1:]) + np.count_nonzero(src)
            tokens += n_tok
            pending.append(loss.detach() * n_tok)
            if i % 20 == 0 or i == len(batches) - 1:
                settle()
                spent = clock() - t0
                rate = tokens / max(spent, 1e-9)
                eta = spent / (i + 1) * (len(batches) - i - 1)
                sys.stdout.write(
                    f"\repoch {epoch + 1} {i + 1}/{len(batches)} loss {loss_sum / tokens:.3f} "
                    f"lr {lr:.2e} {rate:,.0f} tok/s ETA {eta / 60:.1f} min   "
                )
                sys.stdout.flush()
            if clock() - last_save > c.checkpoint_minutes * 60:
                settle()
                save(last, elapsed + clock() - t0)
                last_save = clock()
            if c.steps and step >= c.steps and done_in_epoch < len(batches):
                settle()
                save(last, elapsed + clock() - t0)
                print(f"\nstopped at step {step} (--steps); --resume carries on", flush=True)
                return out / "best.pt" if wrote_best else last
            if elapsed + clock() - t0 >= budget:
                settle()
                out_of_time = True  # the budget ends the run mid-epoch; that partial epoch counts as the last
                break
        elapsed += clock() - t0
        epoch += 1
        epoch_loss = loss_sum / max(tokens, 1)
        done_in_epoch, tokens, loss_sum = 0, 0.0, 0.0
        finished = epoch >= c.epochs or out_of_time or bool(c.steps and step >= c.steps)
        if c.keep_epochs:
            save(out / f"epoch-{epoch:03d}.pt", elapsed, resumable=False)
            for old in sorted(out.glob("epoch-*.pt"))[: -c.keep_epochs]:
                old.unlink()
        if epoch % c.eval_every == 0 or finished:
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
                wrote_best = True
        save(last, elapsed)
        last_save = clock()
        if finished:
            break
    kept = sorted(out.glob("epoch-*.pt"))[-c.keep_epochs :] if c.keep_epochs else []
    if len(kept) > 1:
        write_average(kept, out / "averaged.pt", lexicon, dev_words)
    return out / "best.pt" if wrote_best else last


def save_atomically(state: dict[str, Any], path: Path) -> None:
    """A checkpoint written beside `path`, then renamed over it: a killed run never leaves half a file."""
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def write_average(paths: list[Path], path: Path, lexicon: data.Lexicon, dev_words: list[str]) -> None:
    """The mean of the kept epochs' weights as a checkpoint of its own, with its dev figures."""
    from export.checkpoint import average_checkpoints

    averaged = average_checkpoints(paths)
    result: dict[str, Any] = {**dev_wer(averaged.model, lexicon, dev_words, averaged.graphemes, averaged.phonemes)}
    result.update(averaged=[p.name for p in paths], step=averaged.state["step"])
    state = {**averaged.state, "model": averaged.model.state_dict(), "dev": result}
    save_atomically(state, path)
    with (path.parent / "history.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"{path}: mean of {len(paths)} epochs, dev WER {result['wer']:.3f} "
          f"({result['wer_stress_free']:.3f} stress-free) PER {result['per']:.3f}", flush=True)  # fmt: skip


# Settings that count something a run needs at least one of; every other number must not be negative
# (0 often means "none" or "no limit"), except the seed.
AT_LEAST_ONE = {"d_model", "h", "n_encoder", "n_decoder", "d_ff", "max_tokens", "epochs", "threads", "dev_words",
                "eval_every", "decay_start"}  # fmt: skip
SHARES = {"dropout", "label_smoothing", "distill_weight"}  # from 0 to 1


def check(c: TrainConfig) -> None:
    """A UsageError naming the first flag whose value cannot train, before any data is read."""
    for f in fields(TrainConfig):
        value = getattr(c, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool) or not isinstance(value, int | float) or f.name == "seed":
            continue
        in_range(flag, value, 1 if f.name in AT_LEAST_ONE else 0, 1 if f.name in SHARES else None)
    if c.d_model % c.h:
        raise UsageError(f"--d-model {c.d_model}: must be a multiple of --h {c.h} (the heads split it evenly)")
    try:
        device = torch.device(c.device)
    except RuntimeError:
        raise UsageError(f"--device {c.device}: must be cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {c.device}: torch sees no CUDA device here")
    out = Path(c.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: must be a directory, not a file")
    if c.init:
        readable_file(Path(c.init), "--init checkpoint")
    for teacher in c.teachers.split(",") if c.teachers else []:
        readable_file(Path(teacher), "--teachers checkpoint")


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
    config = TrainConfig(**args)
    check(config)
    written = train(config, resume=resume)
    print(f"{written.stem} checkpoint: {written}")
    return 0
