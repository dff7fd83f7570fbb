"""A learner's checkpoint: its tensors under flat names (``learner/``, ``base/P/``, ``opt/I/``, ``gen``) and a
JSON document (steps, counters, optimizer groups, data position); ``node.learner.learner.Learner.state`` and
``load_state``."""

from __future__ import annotations

import torch


def learner_state(
    lrn, full: tuple[dict[str, torch.Tensor], dict] | None = None, copy: bool = True
) -> tuple[dict[str, torch.Tensor], dict]:
    """The learner's checkpoint. ``full``: (parameters, optimizer state dict) gathered by a sharded unit;
    a sharded learner has no whole state of its own to give. ``copy=False``: the live parameters and
    optimizer state themselves, valid until the next step (for a writer that is done before it; see
    ``node.swarm.checkpoint.PendingCheckpoint``). Bases are never copied: nothing writes to them."""
    if full is None:
        lrn._whole("hand out its state")
        params, opt = (
            {n: (p.detach().to("cpu").clone() if copy else p.detach()) for n, p in lrn.params.items()},
            lrn.opt.state_dict(),
        )
    else:
        params, opt = full
    tensors = {f"learner/{n}": t for n, t in params.items()}
    for p, base in enumerate(lrn.base):
        for n, t in base.items():
            tensors[f"base/{p}/{n}"] = t
    for i, st in opt["state"].items():
        for k, v in st.items():
            v = torch.as_tensor(v).detach()
            tensors[f"opt/{i}/{k}"] = v.to("cpu").clone() if copy else v
    tensors["gen"] = lrn.gen.get_state()
    meta = {
        "steps": lrn.steps,
        "book": lrn.book.state_dict(),
        "param_groups": opt["param_groups"],
        "data_position": lrn.data_position(),
    }
    return tensors, meta


def load_learner_state(lrn, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    lrn._whole("load a checkpoint")
    lrn.snaps.fence()
    with torch.no_grad():
        for n, p in lrn.params.items():
            p.copy_(tensors[f"learner/{n}"].to(lrn.device))
    for p, base in enumerate(lrn.base):
        lrn.base[p] = {n: tensors[f"base/{p}/{n}"].clone() for n in base}
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        if key.startswith("opt/"):
            _, i, k = key.split("/", 2)
            state.setdefault(int(i), {})[k] = v.to(lrn.device) if v.dim() else v
    lrn._new_optimizer()
    lrn.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    lrn.gen.set_state(tensors["gen"])
    lrn.steps = int(meta["steps"])
    lrn.book.load_state_dict(meta["book"])
    if lrn.reader is not None:
        lrn.reader.position = int(meta.get("data_position", 0))
