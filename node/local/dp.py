"""Data-parallel baseline for the in-process runner: every step, all live learners' gradients are averaged
(an all-reduce) and one AdamW step is taken on one shared model.

Virtual time per step: the slowest live learner's step time plus a ring all-reduce of the fp32 gradients
(2 (n-1)/n of the model's bytes over each link, plus latency). A learner that is down is simply left out
(elastic, with no resize cost), which flatters data-parallel. Event records have the same shape as the
fragment systems' (one contribution per learner per step, merged at once), so goodput comes from the same
code.
"""

from __future__ import annotations

import random

import torch

from node.common.events import EventLog
from node.learner.learner import InnerConfig, default_device, lr_lambda
from node.learner.task import Task, evaluate
from node.local.run_config import RunConfig, RunResult, jittered
from protocol.goodput import compute_goodput
from protocol.hashing import tensors_hash


def run_dp(
    task: Task, run: RunConfig, inner: InnerConfig, events: EventLog | None = None, progress=None
) -> RunResult:
    events = events or EventLog()
    model = task.new_model().to(default_device())
    params = [p for p in model.parameters()]
    model_bytes = sum(p.numel() * 4 for p in params)
    opt = torch.optim.AdamW(params, lr=inner.lr, betas=(0.9, 0.95), weight_decay=inner.weight_decay)
    total = max(1, run.token_budget // (run.learners * task.tokens_per_batch))
    lr = lr_lambda(total, inner)
    gens = [torch.Generator().manual_seed(run.seed * 1000 + m + 1) for m in range(run.learners)]
    rngs = [random.Random(run.seed * 7919 + m) for m in range(run.learners)]
    plans = [run.plan(m) for m in range(run.learners)]
    names = [f"L{m}" for m in range(run.learners)]
    for m, pl in enumerate(plans):
        for crash, back in pl.down:
            events.emit("down", t=crash, learner=names[m])
            events.emit("up", t=back, learner=names[m])

    def is_down(m: int, t: float) -> bool:
        return any(c <= t < b for c, b in plans[m].down)

    thresholds = run.eval_thresholds()
    evals = [(0, 0.0, evaluate(task, model))]
    now, tokens, step, sent = 0.0, 0, 0, 0
    while tokens < run.token_budget:
        live = [m for m in range(run.learners) if not is_down(m, now)]
        if not live:
            now = min(b for pl in plans for c, b in pl.down if b > now)
            continue
        for g in opt.param_groups:
            g["lr"] = inner.lr * lr(step)
        opt.zero_grad(set_to_none=True)
        losses = []
        for m in live:
            loss = task.loss(model, task.batch(gens[m])) / len(live)
            loss.backward()
            losses.append(loss.item() * len(live))
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        opt.step()
        step += 1
        durs = {m: jittered(rngs[m], plans[m], run.step_time_s) for m in live}
        n = len(live)
        ring = 2 * (n - 1) / n * model_bytes if n > 1 else 0
        sent += int(ring) * n
        end = now + max(durs.values()) + (run.net.transfer_s(int(ring)) if n > 1 else 0.0)
        cids = []
        for m in live:
            cid = f"{names[m]}:0:{step}"
            cids.append(cid)
            events.emit(
                "step", learner=names[m], step=step, t0=now, t1=now + durs[m], loss=losses[live.index(m)]
            )
            events.emit(
                "contribute",
                t=now + durs[m],
                learner=names[m],
                fragment=0,
                step=step,
                cid=cid,
                bytes=int(ring),
            )
            if end > now + durs[m]:
                events.emit("block", learner=names[m], t0=now + durs[m], t1=end)
        events.emit("merge", t=end, fragment=0, round=step, cids=cids)
        tokens += n * task.tokens_per_batch
        now = end
        while thresholds and tokens >= thresholds[0]:
            thresholds.pop(0)
            evals.append((tokens, now, evaluate(task, model)))
            events.emit("eval", t=now, tokens=tokens, loss=evals[-1][2])
            if progress:
                progress(tokens, run.token_budget, evals[-1][2])
    events.emit("run", system="dp", t0=0.0, t1=now, shares=[1.0], learners=names)
    g = compute_goodput(events.records)
    h = tensors_hash({k: v.detach() for k, v in model.named_parameters()})
    final = {k: v.detach().to("cpu") for k, v in model.named_parameters()}
    return RunResult("dp", evals[-1][2], evals, g.goodput, now, tokens, step, sent, g.steps, h, 0, final)
