"""Train and save the byte-level BPE tokenizer of the default model pair.

    tokenizer = train_tokenizer()                    # ~1 minute on 2 CPU cores
    save_tokenizer(tokenizer, "runs/tokenizer/model")
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained("runs/tokenizer/model").eos_token
    '<|endoftext|>'

Byte-level means every string round-trips (no unknown token). The special tokens of `chat_format`
come first, so ``<|endoftext|>`` is id 0; the saved config carries the chat template.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from verispec.train import corpus
from verispec.train.chat_format import CHAT_TEMPLATE, EOS_TOKEN, SPECIAL_TOKENS
from verispec.train.token_stream import EncodeBatch

logger = logging.getLogger(__name__)

VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 1024
# Characters of training text sampled per workload; a few MB each is plenty for an 8k vocabulary.
SAMPLE_CHARS = {"chat": 4_000_000, "code": 4_000_000, "math": 1_000_000}


def _sample_documents(chars_per_workload: dict[str, int]) -> Iterator[str]:
    for name, budget in chars_per_workload.items():
        documents = corpus.load_workload(name, "train")  # type: ignore[arg-type]
        # Take evenly spaced documents so the sample spans the whole (ordered) workload.
        mean_chars = max(sum(map(len, documents)) // max(len(documents), 1), 1)
        stride = max(len(documents) * mean_chars // budget, 1)
        used = 0
        for document in documents[::stride]:
            if used >= budget:
                break
            used += len(document)
            yield document
        logger.info("tokenizer sample: %s %.1f MB", name, used / 1e6)


def train_tokenizer(vocab_size: int = VOCAB_SIZE, chars_per_workload: dict[str, int] | None = None) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` trained on a sample of the train split only."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_sample_documents(chars_per_workload or SAMPLE_CHARS), trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) loadable by AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(str(out_dir))
    _write_portable_config(Path(out_dir))
    logger.info("saved tokenizer (%d tokens) to %s", tokenizer.get_vocab_size(), out_dir)


def _write_portable_config(out_dir: Path) -> None:
    # transformers 5 names the class TokenizersBackend and writes chat_template.jinja; 4.x readers need the
    # older class name and the template inside tokenizer_config.json. Both versions read this form.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    special = [t for t in SPECIAL_TOKENS if t != EOS_TOKEN]
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
                  additional_special_tokens=special)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    special_map = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "additional_special_tokens": special}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    compact_tokenizer_json(out_dir / "tokenizer.json")


def compact_tokenizer_json(path: Path) -> None:
    """Rewrite tokenizer.json without indentation: the same tokenizer in ~40% of the bytes (it ships
    twice inside the package, once per checkpoint dir, under the model files' size limit)."""
    Tokenizer.from_file(str(path)).save(str(path), pretty=False)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The raw `tokenizers.Tokenizer` from a saved directory (fast path for bulk encoding)."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer.json in {directory}; run `verispec train tokenizer` first")
    return Tokenizer.from_file(str(path))


def batch_encoder(tokenizer: Tokenizer) -> EncodeBatch:
    """``encode(["ab", "c"]) -> [[ids of ab], [ids of c]]`` with no special tokens added."""
    def encode(texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return encode


def corpus_statistics(tokenizer: Tokenizer) -> dict:
    """Documents, characters and tokens per workload and split, plus the chat filter counts."""
    encode = batch_encoder(tokenizer)
    stats: dict = {"vocab_size": tokenizer.get_vocab_size(), "heldout_percent": corpus.HELDOUT_PERCENT,
                   "chat_filter": corpus.chat_filter_counts(), "workloads": {}}
    for name in corpus.WORKLOADS:
        per_split = {}
        for split in ("train", "heldout"):
            documents = corpus.load_workload(name, split)
            tokens = sum(len(ids) for start in range(0, len(documents), 256)
                         for ids in encode(documents[start:start + 256]))
            per_split[split] = {"documents": len(documents), "chars": sum(map(len, documents)), "tokens": tokens}
        stats["workloads"][name] = {**per_split, "synthetic": name in corpus.SYNTHETIC_WORKLOADS}
    return stats
