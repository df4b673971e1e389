"""Build tiny random-weight Llama models with a locally trained tokenizer (no model hub).

Run by the vLLM venv's own python, which has torch, transformers and tokenizers; the test venv
has none of them, so this file imports nothing from the project and is driven by a JSON spec:

    python build_models.py SPEC.json

SPEC is {"tokenizer": {...}, "models": [{"out": DIR, "config": {...}, "seed": N}, ...]}. Each model
directory is written beside its final place and renamed into it, so a crashed build never leaves a
directory that looks finished.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# ChatML: what Qwen-style chat models use, and what vLLM's chat endpoint renders through
# tokenizer_config.json's chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD, EOS = "<|endoftext|>", "<|im_end|>"

# Common English words, so that English prompts tokenize at a realistic few characters per token
# (the gateway calibrates its token estimate against vLLM's usage counts).
WORD_TEXT = """the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no will more can
out up about who its them than into only other some time could these two may first then do any like
my now over such our man me even most made after also did many before must through back years where
much your way well down should because each just those people how too little state good very make
world still own see men work long get here between both life being under never day same another know
while last might us great old year off come since against go came right used take three system
prompt token model request server queue prefill decode cache block latency fleet gateway instance
slow fast card batch stream usage error metric health ready load score route client reply answer
summarise document article question number value table list input output text line word page data
"""
WORDS = WORD_TEXT.split()


def corpus(seed: int, lines: int) -> list[str]:
    """Deterministic text: English-like sentences, made-up words, numbers, JSON and chat markup."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    out: list[str] = []
    for n in range(lines):
        kind = n % 5
        if kind == 0:
            made_up = [
                "".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(rng.randint(4, 12))
            ]
            out.append(" ".join(made_up).capitalize() + ".")
        elif kind == 1:
            out.append(f'{{"id": {rng.randint(0, 99999)}, "name": "{rng.choice(WORDS)}", "ok": true}}')
        elif kind == 2:
            out.append(f"<|im_start|>user\n{' '.join(rng.choices(WORDS, k=rng.randint(5, 20)))}<|im_end|>")
        else:
            words = rng.choices(WORDS, k=rng.randint(6, 30))
            words += [str(rng.randint(0, 10 ** rng.randint(1, 6)))]
            rng.shuffle(words)
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ";", ":"]))
    return out


def build_tokenizer(spec: dict[str, Any], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(spec["seed"], spec["corpus_lines"]), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    # Written by hand rather than by transformers' save_pretrained, which puts the template in a
    # separate chat_template.jinja: both load, but tokenizer_config.json is where most models keep it.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": spec["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(tok)): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": PAD}) + "\n")


def build_model(spec: dict[str, Any], tokenizer_dir: Path, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos, pad = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)
    torch.manual_seed(spec["seed"])
    config = LlamaConfig(**spec["config"], bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(tokenizer_dir / name, out / name)


def build_into(out: Path, build: Callable[[Path], None]) -> None:
    """Run ``build`` in a scratch directory beside ``out``, then rename it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"built {out}", flush=True)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    tokenizer_out = Path(spec["tokenizer"]["out"])
    if not tokenizer_out.is_dir():
        build_into(tokenizer_out, functools.partial(build_tokenizer, spec["tokenizer"]))
    for model in spec["models"]:
        out = Path(model["out"])
        if not out.is_dir():
            build_into(out, functools.partial(build_model, model, tokenizer_out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
