"""A tied embedding's lookup leaves the tensor's gradient to the head on a plain CPU learner and adds its rows
after the backward pass (``node.learner.model.lean_lookup``, ``flush_lookup``): the same gradients, dense,
and two vocab x dim tensors less at the peak of each backward."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from node.learner.model import flush_lookup, lean_lookup, tied_lookup

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


def _gpt2(vocab: int = 2048, dim: int = 64, layers: int = 2) -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=dim, n_layer=layers, n_head=4, n_positions=32, vocab_size=vocab)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().train()


def _grads(model: torch.nn.Module, lean: bool, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lean_lookup(model, lean)
    torch.manual_seed(5)  # the same dropout masks
    logits = model(input_ids=x[:, :-1]).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
    flush_lookup(model)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _lean(emb: torch.nn.Embedding) -> bool:
    return "forward" in vars(emb)


def test_the_lean_lookup_gives_the_dense_lookups_gradients():
    model = _gpt2()
    emb = tied_lookup(model)
    assert emb is model.transformer.wte and emb.weight is model.lm_head.weight
    x = torch.randint(0, 2048, (3, 33), generator=torch.Generator().manual_seed(1))
    dense = _grads(model, False, x)
    lean = _grads(model, True, x)
    assert _lean(emb)
    assert set(dense) == set(lean)
    for n in dense:
        assert lean[n].layout == torch.strided, n
        torch.testing.assert_close(lean[n], dense[n], rtol=1e-5, atol=1e-7, msg=n)
    lean_lookup(model, False)
    assert not _lean(emb)
    assert torch.equal(_grads(model, False, x)[next(iter(dense))], dense[next(iter(dense))])


def test_a_padding_row_takes_no_gradient_from_the_lean_lookup():
    model = _gpt2(vocab=64)
    emb = tied_lookup(model)
    emb.padding_idx = 3
    x = torch.tensor([[3, 5, 3, 7, 3, 9, 3, 11, 3]])
    dense, lean = _grads(model, False, x), _grads(model, True, x)
    name = next(n for n, p in model.named_parameters() if p is emb.weight)
    torch.testing.assert_close(lean[name], dense[name], rtol=1e-5, atol=1e-7)


def test_only_a_tied_plain_embedding_is_made_lean():
    from node.learner.model import ModelConfig, TinyGPT

    assert tied_lookup(TinyGPT(ModelConfig())) is None  # its head is a tensor of its own
    untied = _gpt2()
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert tied_lookup(untied) is None
    lean_lookup(untied, True)
    assert not _lean(untied.transformer.wte)  # its gradient is its own: nothing to leave to a head


def test_a_cpu_learner_steps_with_the_lean_lookup_and_a_wrapped_one_without(tmp_path):
    from node.learner.learner import InnerConfig, Learner
    from node.learner.model import ModelConfig
    from node.learner.task import TaskConfig, load_task
    from protocol.config import ProtocolConfig

    task = load_task(
        None, TaskConfig(model=ModelConfig(name="gpt2", dim=32, layers=1, heads=2, seq_len=16), batch_size=2)
    )
    lrn = Learner("a", task, ProtocolConfig(), InnerConfig(), 10, seed=0)
    emb = tied_lookup(lrn.model)
    assert emb is not None
    before = emb.weight.detach().clone()
    lrn.train_step()
    assert _lean(emb) and not torch.equal(before, emb.weight.detach())  # the step moved the tied tensor
    lrn.forward_model = torch.nn.Sequential(lrn.model)  # what a DDP unit does: a wrapper around the model
    lrn.forward_model.forward = lrn.model.forward
    lrn.train_step()
    assert not _lean(emb)


_CHILD = r"""
import os, sys, torch, torch.nn.functional as F, transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_embd=512, n_layer=1, n_head=8, n_positions=32, vocab_size=32768)
m = transformers.AutoModelForCausalLM.from_config(cfg).float().train()
from node.learner.model import flush_lookup, lean_lookup
x = torch.randint(0, 32768, (2, 33))

def hwm():
    with open("/proc/self/status") as fh:
        return int(fh.read().split("VmHWM:")[1].split()[0]) * 1024

out = []
for lean in (False, True, False, True):
    m.zero_grad(set_to_none=True)
    lean_lookup(m, lean)
    loss = F.cross_entropy(m(input_ids=x[:, :-1]).logits.reshape(-1, 32768), x[:, 1:].reshape(-1))
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM back to what is resident now
    start = hwm()
    loss.backward()
    flush_lookup(m)
    out.append(hwm() - start)
print(*out)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's clear_refs")
@pytest.mark.slow
def test_the_lean_lookup_takes_two_embeddings_less_at_the_peak_of_a_backward():
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )
    assert res.returncode == 0, res.stderr[-2000:]
    d1, l1, d2, l2 = (int(v) for v in res.stdout.split())
    emb = 32768 * 512 * 4
    # the dense lookup's zero-filled gradient, and autograd's sum of it and the head's, are gone (a sparse
    # lookup gradient took the first away, not the sum)
    assert min(d1, d2) - max(l1, l2) >= 1.8 * emb, (d1, l1, d2, l2, emb)
