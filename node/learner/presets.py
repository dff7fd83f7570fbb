"""``--preset``: a model and batch in one word. A preset fills in the [model] and [task] settings the TOML
file and the flags leave unset, so ``--preset small --seq-len 128`` is the small model at 128 tokens."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # today's default: about 0.9M parameters, for quick runs and tests on a laptop's CPU
    "tiny": {"model": {"name": "tiny", "dim": 128, "layers": 4, "heads": 4, "seq_len": 128}, "task": {"batch_size": 16}},
    # about 10M parameters: trains on CPU cores, slowly but for real
    "small": {"model": {"name": "tiny", "dim": 320, "layers": 8, "heads": 8, "seq_len": 256}, "task": {"batch_size": 16}},
    # GPT-2 small's architecture (124M with its 50257-token vocabulary), for a GPU: steps run under bf16 autocast
    "gpt2-125m": {
        "model": {"name": "gpt2", "dim": 768, "layers": 12, "heads": 12, "seq_len": 1024},
        "task": {"batch_size": 8},
    },
}  # fmt: skip


def apply_preset(values: dict[str, dict[str, Any]]) -> None:
    """Fill ``values`` (section -> settings given) with the preset named in ``values['task']['preset']``,
    leaving every setting that was given as it is. An unknown name is left for TaskConfig to refuse."""
    preset = PRESETS.get(values.get("task", {}).get("preset", ""))
    for section, settings in (preset or {}).items():
        if section in values:
            for k, v in settings.items():
                values[section].setdefault(k, v)
