"""The tiny models the real servers load: specs, their cache directories, and building them."""

from __future__ import annotations

import hashlib
import json
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BUILDER = Path(__file__).with_name("build_models.py")
BUILD_TIMEOUT = 600.0
CONTEXT = 4096  # max_position_embeddings, hence vLLM's max model length
VOCAB = 4096

Log = Callable[[str], None]


@dataclass(frozen=True)
class TokenizerSpec:
    """A byte-level BPE trained on a generated corpus; the seed makes the corpus the same every time."""

    vocab_size: int = VOCAB
    seed: int = 1
    corpus_lines: int = 40_000
    max_position_embeddings: int = CONTEXT


@dataclass(frozen=True)
class ModelSpec:
    """A random-weight LlamaForCausalLM (bf16); only the width and depth differ between cards."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    seed: int

    def config(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "head_dim": self.hidden_size // self.num_attention_heads,
            "vocab_size": VOCAB,
            "max_position_embeddings": CONTEXT,
            "tie_word_embeddings": False,
        }


TOKENIZER = TokenizerSpec()
FAST = ModelSpec(
    "fast", hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, seed=2
)
SLOW = ModelSpec(
    "slow", hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8, seed=3
)


@dataclass(frozen=True)
class BuiltModels:
    """Model directories by spec name, and the shared tokenizer.json (taogate's ``[prefill] tokenizer``)."""

    dirs: dict[str, Path]
    tokenizer_json: Path


def _digest(*parts: Any) -> str:
    # The builder's source is part of the key: changing how models are made must rebuild them.
    text = json.dumps(parts, sort_keys=True) + BUILDER.read_text()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_dirs(
    models_home: Path, specs: Sequence[ModelSpec], tokenizer: TokenizerSpec = TOKENIZER
) -> BuiltModels:
    """Where each model is cached: ``<name>-<hash of its parameters, the tokenizer's and the builder's>``."""
    tok_key = _digest(asdict(tokenizer))
    dirs = {spec.name: models_home / f"{spec.name}-{_digest(tok_key, asdict(spec))}" for spec in specs}
    return BuiltModels(dirs, models_home / f"tokenizer-{tok_key}" / "tokenizer.json")


def ensure_models(
    python: Path,
    models_home: Path,
    specs: Sequence[ModelSpec],
    *,
    log: Log,
    tokenizer: TokenizerSpec = TOKENIZER,
) -> BuiltModels:
    """Build whichever models are not cached yet, with the vLLM venv's python (it has torch)."""
    built = model_dirs(models_home, specs, tokenizer)
    if built.tokenizer_json.exists() and all(path.is_dir() for path in built.dirs.values()):
        return built
    models_home.mkdir(parents=True, exist_ok=True)
    job = {
        "tokenizer": {"out": str(built.tokenizer_json.parent), **asdict(tokenizer)},
        "models": [
            {"out": str(built.dirs[spec.name]), "seed": spec.seed, "config": spec.config()} for spec in specs
        ],
    }
    log(f"building models {', '.join(spec.name for spec in specs)} into {models_home}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=models_home, delete=False) as handle:
        json.dump(job, handle)
    job_path = Path(handle.name)
    try:
        done = subprocess.run(
            [str(python), str(BUILDER), str(job_path)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"building the models took over {BUILD_TIMEOUT:.0f} s") from None
    finally:
        job_path.unlink(missing_ok=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise RuntimeError(f"building the models failed (exit code {done.returncode}):\n{tail}")
    return built
