"""Builds a tiny local model directory: a byte-level BPE tokenizer trained here plus a
LlamaForCausalLM config, so the demo, the sim engines and a real vLLM (`--load-format
dummy`) all tokenize identically without any model hub.

`kvroute tiny-model DIR` writes one for running the pieces by hand (`--tokenizer DIR` of the sim
engine and the router). Its own subcommand rather than a sim-engine flag: the directory serves the
router and a real vLLM as much as the sim engine, and writing files is a one-off, not a server.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

MODEL_DIR_VERSION = "2"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (  # tools as real templates render them: a block before the messages, only when given
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "can",
    "has",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "cache",
    "token",
    "prefix",
    "router",
    "worker",
    "model",
    "request",
    "latency",
    "block",
    "memory",
    "engine",
    "query",
    "index",
    "policy",
    "load",
    "queue",
    "system",
    "user",
    "assistant",
    "document",
    "answer",
    "question",
    "tool",
    "schema",
    "function",
    "value",
    "result",
    "error",
    "time",
    "first",
    "compute",
    "prefill",
    "decode",
    "batch",
    "stream",
    "event",
    "key",
    "hash",
    "store",
    "remove",
    "update",
    "graph",
    "kernel",
    "tensor",
    "layer",
]


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 30))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ","]))
    return lines


def build_model_dir(path: str | Path, vocab_size: int = 2048) -> Path:
    """Create (or reuse, if already built with this version) a tiny model directory."""
    out = Path(path)
    stamp = out / ".kvroute-tiny-model"
    if stamp.exists() and stamp.read_text() == MODEL_DIR_VERSION:
        return out
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(4000, seed=7), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))

    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "</s>",
                "model_max_length": 4096,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}, indent=2)
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": tokenizer.get_vocab_size(),
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "torch_dtype": "float32",
                "bos_token_id": tokenizer.token_to_id("<s>"),
                "eos_token_id": tokenizer.token_to_id("</s>"),
                "tie_word_embeddings": False,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tokenizer.token_to_id("<s>"), "eos_token_id": tokenizer.token_to_id("</s>")})
    )
    stamp.write_text(MODEL_DIR_VERSION)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir",
        help="directory to write (its name is the model name routers default to, e.g. "
        "models/tiny-llama); an existing tiny model there is kept",
    )


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    stamp = out / ".kvroute-tiny-model"
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not stamp.exists())):
        print(f"kvroute tiny-model: {out} exists and is not a tiny model directory; name a new or empty one", file=sys.stderr)
        return 2
    try:
        build_model_dir(out)
    except OSError as exc:
        print(f"kvroute tiny-model: cannot write {out}: {exc}", file=sys.stderr)
        return 2
    print(
        f"tiny model in {out}: tokenizer.json (vocabulary {json.loads((out / 'config.json').read_text())['vocab_size']}), "
        f"chat template, LlamaForCausalLM config; use it as --tokenizer {out}"
    )
    return 0
