"""Example inputs for docs/custom-task.md, made here from generated text (nothing is downloaded):

    python -m node.learner.examples examples/

writes ``examples/llama/config.json`` (a small Llama-style causal LM, tied embeddings),
``examples/tokenizer.json`` (a byte-level BPE tokenizer trained on generated text),
``examples/jsonl/part-0000{0,1}.jsonl`` and ``examples/parquet/part-0000{0,1}.parquet`` (the same documents,
under "text"), and ``examples/text.txt``.
Needs the [hf] extra (tokenizers, pyarrow).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from node.learner.data import generated_text

EOS = "<|endoftext|>"


def documents(n_bytes: int, seed: int = 7) -> list[str]:
    """Generated text cut into documents of a few lines each."""
    lines = [x for x in generated_text(n_bytes, seed).decode().split("\n") if x.strip()]
    return ["\n".join(lines[i : i + 3]) for i in range(0, len(lines), 3)]


def train_tokenizer(docs: list[str], vocab_size: int, path: Path) -> int:
    """A byte-level BPE tokenizer trained on ``docs``, saved to ``path``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok.get_vocab_size()


def llama_config(
    vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, positions: int = 256
) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": positions,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def write_shards(docs: list[str], folder: Path, kind: str, n_shards: int = 2) -> list[Path]:
    """``docs`` split over ``n_shards`` shards of ``kind`` (jsonl or parquet) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(n_shards):
        part, path = docs[k::n_shards], folder / f"part-{k:05d}.{kind}"
        if kind == "jsonl":
            path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(part)))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": part}), path)
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m node.learner.examples", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder to write into")
    ap.add_argument("--bytes", type=int, default=400_000, help="generated text to make (default 400000)")
    ap.add_argument("--vocab", type=int, default=512, help="tokenizer vocabulary (default 512)")
    a = ap.parse_args(argv)
    try:
        import pyarrow  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        print(f"examples: {e.name} is missing: pip install 'ddiloco[hf]'", file=sys.stderr)
        return 2
    docs = documents(a.bytes)
    vocab = train_tokenizer(docs, a.vocab, a.out / "tokenizer.json")
    (a.out / "llama").mkdir(parents=True, exist_ok=True)
    (a.out / "llama" / "config.json").write_text(json.dumps(llama_config(vocab), indent=2) + "\n")
    write_shards(docs, a.out / "jsonl", "jsonl")
    write_shards(docs, a.out / "parquet", "parquet")
    (a.out / "text.txt").write_text("\n".join(docs) + "\n")
    print(f"wrote {a.out}/: llama/config.json, tokenizer.json ({vocab} tokens), jsonl/, parquet/, text.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
