"""Precise mode's per-request cost at intake: rendering, encoding and hashing a prompt's blocks.

Compares, in one run, the whole prompt (what intake did before it was bounded: every token encoded
and hashed, the ids kept while the request queues) with the bounded prefix (``MAX_PREFIX_TOKENS``
at most, only the hashes kept), for chat prompts of growing size. Prints milliseconds per request
(median of a few runs) and what each keeps in memory.

    flock /tmp/taogate-heavy.lock .venv/bin/python benchmarks/precise_intake.py [--tokenizer tokenizer.json]

Without ``--tokenizer`` a byte-level BPE is trained here on generated words (no model hub).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from taogate.dispatch.token_ids import MAX_PREFIX_TOKENS, PromptTokenizer, load_prompt_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BLOCK = 128  # vLLM's block size on CPU


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(n))


def _trained(workdir: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((_words(200, s) for s in range(2000)), trainer=trainer)
    path = workdir / "tokenizer.json"
    tok.save(str(path))
    (workdir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return path


def _ms(tok: PromptTokenizer, body: dict[str, object], cap: int | None, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        tok.blocks("chat", body, (BLOCK,), cap)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json with a chat template beside it")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.tokenizer or _trained(Path(tmp))
        tok = load_prompt_tokenizer(path)
        print(f"block size {BLOCK}, cap {MAX_PREFIX_TOKENS} tokens, median of {args.runs} runs")
        head = ("words", "tokens", "whole ms", "bounded ms", "kept whole", "kept now")
        print(" ".join(f"{h:>11}" for h in head))
        for words in (1_000, 8_000, 32_000, 128_000, 512_000):
            body: dict[str, object] = {"messages": [{"role": "user", "content": _words(words, words)}]}
            ids = tok.ids("chat", body) or []
            whole = _ms(tok, body, None, args.runs)
            bounded = _ms(tok, body, MAX_PREFIX_TOKENS, args.runs)
            blocks = tok.blocks("chat", body, (BLOCK,), MAX_PREFIX_TOKENS)
            kept_now = len(blocks.hashes(BLOCK)) if blocks else 0
            # before: the ids (one int each) and the hashes; now: the hashes only
            kept_before = len(ids) + max(0, len(ids) - 1) // BLOCK
            row = (words, len(ids), f"{whole:.1f}", f"{bounded:.1f}", kept_before, kept_now)
            print(" ".join(f"{c:>11}" for c in row))


if __name__ == "__main__":
    main()
