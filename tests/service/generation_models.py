"""Tiny generation models for the tests: a GPT-2 (decoder-only) and a T5 (encoder-decoder), built from
transformers configs with fixed random weights (no model hub), each with a tokenizer trained here on a
fixed English text, and exported by optimum's own exporter as `optimum-cli export onnx` writes them
(`text-generation-with-past`, `text2text-generation-with-past`), tokenizer files and generation_config.json
beside the graphs.

Building takes some 20 s (torch, transformers and optimum imported, two exports), so the folders are kept
on disk under a key hashed from this module's source and the library versions: every test file and every
xdist worker reuses one build (a lock file makes them wait for it, an atomic rename publishes it).

The weights are scaled up from transformers' initialisation (and the end-of-sequence row of the tied
embedding moved) so that greedy outputs vary from prompt to prompt and end at different lengths, some on
EOS and some at the token limit, as real answers do. Each build keeps transformers' greedy answers to
PROMPTS (greedy.json), the reference the engine's tests compare with.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE",
    "GREEDY_TOKENS",
    "LONG_PROMPT",
    "PROMPTS",
    "TEXT",
    "causal_folder",
    "exported",
    "greedy_answers",
    "seq2seq_folder",
]

# Where the exports are kept: QKV_GENERATION_MODELS, or a folder in the temporary directory.
CACHE = Path(os.environ.get("QKV_GENERATION_MODELS") or Path(tempfile.gettempdir()) / "qkv-generation-models")

# The tokenizers' training text, and where the test prompts come from.
TEXT = """\
The quick brown fox jumps over the lazy dog. A model server answers requests for many users at once.
Every morning the baker opens the shop and sells fresh bread to the people of the town.
She reads a book about the history of the sea, the ships and the sailors who crossed it.
Rain fell on the old stone bridge while the river ran fast and brown beneath it.
The children played in the garden until the sun went down behind the hills.
A small cat sat by the window and watched the birds in the tall green tree.
He wrote a letter to his friend, telling him about the long journey to the north.
Music filled the hall as the orchestra began to play the first notes of the evening.
The scientist measured the light from distant stars with a new and careful instrument.
Translate English to German: the house is wonderful. Summarize: the meeting was long and nothing was decided.
Questions and answers: what is the capital of France? Paris is the capital of France.
Numbers count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten.
Café, naïve, façade and jalapeño keep their accents; so do Zürich, São Paulo and Kraków.
"""

# 64 prompts of mixed lengths (1 to some 60 tokens), cut from the text.
_WORDS = TEXT.split()
PROMPTS: tuple[str, ...] = tuple(
    " ".join(_WORDS[(7 * i) % len(_WORDS) : (7 * i) % len(_WORDS) + 1 + (i * 5) % 37]) for i in range(64)
)

# A prompt of some 700 tokens: longer than a step's token budget, so the engine prefills it in chunks.
LONG_PROMPT = " ".join([TEXT.replace("\n", " ")] * 3)
VOCAB = 500
GREEDY_TOKENS = 32  # max_new_tokens of the greedy answers kept with each build (greedy.json)
N_POSITIONS = 2048  # GPT-2's positions: room for a 2,000-token prompt
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _scaled(model: Any, scale: float, eos: int, eos_scale: float) -> Any:
    """`model` with every weight matrix scaled by `scale` (random weights at transformers' initialisation give
    near-flat logits), and the EOS row of the output embedding by `eos_scale`, so that EOS wins in some
    states and not others: the answers end at lengths spread from 1 to the token limit."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "norm" not in name and "ln" not in name:
                p.mul_(scale)
        model.get_output_embeddings().weight[eos] *= eos_scale
    return model


def _causal_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", model_max_length=N_POSITIONS,
                                   model_input_names=["input_ids", "attention_mask"])  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _seq2seq_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=512, model_input_names=["input_ids", "attention_mask"])  # fmt: skip
    fast.save_pretrained(out)
    return fast


def _export(saved: Path, out: Path, task: str) -> None:
    from optimum.exporters.onnx import main_export

    with warnings.catch_warnings():  # the exporters' own deprecation notices
        warnings.simplefilter("ignore")
        main_export(str(saved), output=out, task=task, do_validation=False, device="cpu")


def _greedy(model: Any, tokenizer: Any, root: Path, decoder_only: bool) -> None:
    """transformers' greedy answers to PROMPTS and LONG_PROMPT (batch 1, no padding), EOS included: greedy.json."""
    import torch

    answers = []
    with torch.no_grad():
        for prompt in (*PROMPTS, LONG_PROMPT):
            ids = tokenizer(prompt, return_tensors="pt")
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            out = model.generate(**ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=pad)
            answers.append(out[0, ids.input_ids.shape[1] if decoder_only else 1 :].tolist())
    (root / "greedy.json").write_text(json.dumps(answers))


def greedy_answers(folder: Path) -> list[list[int]]:
    """The greedy answers kept with a build: one token list a prompt of PROMPTS, then LONG_PROMPT's."""
    answers: list[list[int]] = json.loads((folder / "greedy.json").read_text())
    return answers


def _build_causal(root: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    saved = root / "torch"
    tokenizer = _causal_tokenizer(saved)
    eos = tokenizer.eos_token_id
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(tokenizer), n_positions=N_POSITIONS,
                        bos_token_id=eos, eos_token_id=eos)  # fmt: skip
    torch.manual_seed(0)
    model = _scaled(GPT2LMHeadModel(config).eval(), 8.0, eos, 4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(saved)
    _export(saved, root / "onnx", "text-generation-with-past")
    _greedy(model, tokenizer, root, decoder_only=True)


def _build_seq2seq(root: Path) -> None:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    saved = root / "torch"
    tokenizer = _seq2seq_tokenizer(saved)
    config = T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
                      vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = _scaled(T5ForConditionalGeneration(config).eval(), 4.0, 1, 3.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(saved)
    _export(saved, root / "onnx", "text2text-generation-with-past")
    _greedy(model, tokenizer, root, decoder_only=False)


def _key() -> str:
    from importlib.metadata import version

    source = Path(__file__).read_bytes()
    libraries = "".join(version(p) for p in ("torch", "transformers", "optimum", "optimum-onnx", "tokenizers"))
    return hashlib.sha256(source + libraries.encode()).hexdigest()[:16]


def exported(name: str, build: Callable[[Path], None]) -> Path:
    """The folder `build` writes (`torch/`: the transformers model and tokenizer; `onnx/`: the export),
    built once per key: later callers, in this process or another, get the kept one."""
    folder = CACHE / f"{name}-{_key()}"
    if (folder / "done").exists():
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker building it: wait, then take its build
        try:
            if not (folder / "done").exists():
                partial = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=CACHE))
                try:
                    build(partial)
                    (partial / "done").write_text(json.dumps({"key": _key()}))
                    shutil.rmtree(folder, ignore_errors=True)
                    os.rename(partial, folder)
                finally:
                    shutil.rmtree(partial, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def causal_folder() -> Path:
    """The GPT-2 build: `torch/` for transformers, `onnx/` as optimum exported it (model.onnx, tokenizer)."""
    return exported("gpt2", _build_causal)


def seq2seq_folder() -> Path:
    """The T5 build: `torch/` for transformers, `onnx/` (encoder_model.onnx, decoder_model_merged.onnx, ...)."""
    return exported("t5", _build_seq2seq)
