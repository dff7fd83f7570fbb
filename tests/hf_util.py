"""Inputs for the transformers tests, made by the test: a tiny Llama-style config.json, a BPE tokenizer
trained on generated text, and JSONL shards of that text. Needs the [hf] extra (the tests skip without)."""

from __future__ import annotations

import json
from pathlib import Path

from node.learner.data import generated_text

HIDDEN, LAYERS, HEADS, SEQ = 32, 2, 4, 32


def docs(n_bytes: int = 120_000) -> list[str]:
    lines = [x for x in generated_text(n_bytes, 11).decode().split("\n") if x.strip()]
    return ["\n".join(lines[i : i + 2]) for i in range(0, len(lines), 2)]


def make_inputs(root: Path, vocab: int = 300, model_vocab: int | None = None) -> dict[str, str]:
    """Writes root/{tokenizer.json, llama/config.json, shards/part-*.jsonl}; returns their paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root.mkdir(parents=True, exist_ok=True)
    texts = docs()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(root / "tokenizer.json"))
    config = {
        "model_type": "llama",
        "vocab_size": model_vocab or tok.get_vocab_size(),
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    }
    (root / "llama").mkdir(exist_ok=True)
    (root / "llama" / "config.json").write_text(json.dumps(config))
    shards = root / "shards"
    shards.mkdir(exist_ok=True)
    for k in range(2):
        lines = (json.dumps({"text": t}) for t in texts[k::2])
        (shards / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
    return {
        "tokenizer": str(root / "tokenizer.json"),
        "config": str(root / "llama" / "config.json"),
        "model": f"hf:{root / 'llama'}",
        "data": str(shards),
    }
