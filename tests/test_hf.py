"""Your model: a transformers causal LM from a config.json and a tokenizer the test trains, trained in the
in-process runner and in a swarm of two real node processes, exported as a save_pretrained folder that
``AutoModelForCausalLM.from_pretrained`` loads with the trained global model's logits."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from transformers import AutoModelForCausalLM  # noqa: E402

from node.cli.main import main  # noqa: E402
from node.learner.learner import InnerConfig  # noqa: E402
from node.learner.model import ModelConfig  # noqa: E402
from node.learner.task import TaskConfig, load_task  # noqa: E402
from node.local.run_config import RunConfig  # noqa: E402
from node.local.runner import VirtualSwarm  # noqa: E402
from node.swarm.checkpoint import export_model, export_pretrained, pretrained_folder  # noqa: E402
from protocol.config import ProtocolConfig  # noqa: E402
from protocol.errors import ConfigError  # noqa: E402
from tests.hf_util import SEQ, make_inputs  # noqa: E402
from tests.swarm_util import TINY, Swarm, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("hf"))


def hf_task(inputs, **kw):
    return load_task(
        None,
        TaskConfig(
            data=inputs["data"],
            tokenizer=inputs["tokenizer"],
            batch_size=8,
            eval_batches=4,
            model=ModelConfig(name=inputs["model"], seq_len=SEQ),
            **kw,
        ),
    )


def same_logits(task, params, folder) -> None:
    """The model in ``folder`` (from_pretrained) and ``params`` in the task's model give identical logits."""
    trained = task.new_model()
    missing, unexpected = trained.load_state_dict(params, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # the head is the tied embedding
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight  # still tied
    x = task.eval_batches()[0][0]
    with torch.no_grad():
        a, b = trained.eval()(input_ids=x).logits, loaded.eval()(input_ids=x).logits
    assert torch.equal(a, b)


@pytest.mark.slow
def test_tiny_llama_trains_in_the_runner_and_its_export_loads_with_the_same_logits(inputs, tmp_path):
    task = hf_task(inputs)
    model = task.new_model()
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and task.embedding == "model.embed_tokens.weight"  # tied: once
    run = RunConfig(system="decoupled", learners=2, token_budget=2 * 8 * SEQ * 80, eval_points=2)
    swarm = VirtualSwarm(task, run, ProtocolConfig(fragments=4, sync_every=8), InnerConfig(lr=3e-3))
    res = swarm.run()
    assert res.evals[-1][2] < res.evals[0][2] - 0.5, res.evals
    assert res.merges > 0
    for slot in swarm.slots:  # adoptions copied into the one tensor: the head is still the embedding
        m = slot.learner.model
        assert m.get_output_embeddings().weight is m.get_input_embeddings().weight
        assert slot.learner.data_position() > 0
    out = export_model(tmp_path / "model.safetensors", res.final_params)
    folder = export_pretrained(task, out, res.final_params)
    assert folder == pretrained_folder(out) and (folder / "config.json").is_file()
    assert (folder / "model.safetensors").is_file()
    same_logits(task, res.final_params, folder)
    # the export is a model folder to train on from: hf:FOLDER starts from its weights
    again = hf_task({**inputs, "model": f"hf:{folder}"}).new_model()
    assert all(torch.equal(p, res.final_params[n]) for n, p in again.named_parameters())


@pytest.mark.slow
def test_two_node_processes_train_a_tiny_llama_and_export_it(inputs, tmp_path):
    from safetensors.torch import load_file

    flags = TINY + ["--model", inputs["model"], "--tokenizer", inputs["tokenizer"], "--data", inputs["data"]]
    swarm = Swarm(tmp_path / "swarm", flags)
    try:
        swarm.start_many(2, {0: ["--data-part", "0/2"], 1: ["--data-part", "1/2"]})

        def evals() -> list[float]:
            return [e["loss"] for e in swarm.events(0) if e["kind"] == "eval"]

        def merges() -> int:
            return sum(e["kind"] == "merge" for i in (0, 1) for e in swarm.events(i))

        wait_until(lambda: merges() >= 6, 180, "6 merges between the two nodes")
        wait_until(lambda: len(evals()) >= 2 and min(evals()[1:]) < evals()[0] - 0.3, 180, "the loss to fall")
        swarm.settle()
    finally:
        swarm.stop()
    for i in (0, 1):
        final = json.loads((swarm.children[i].state_dir / "final.json").read_text())
        assert "failed" not in final.get("stop_reason", ""), final
    state = swarm.children[0].state_dir
    params = load_file(str(state / "model.safetensors"))
    same_logits(hf_task(inputs), params, state / "model-hf")


@pytest.mark.slow
def test_the_default_fragments_fit_a_model_with_fewer_tensors(inputs, capsys, caplog):
    from node.learner.learner import Learner

    task = hf_task(inputs)
    tensors = len(list(task.new_model().parameters()))
    assert tensors < 24  # the tiny Llama: the default of 24 fragments does not fit it
    lrn = Learner("a", task, ProtocolConfig(sync_every=4), InnerConfig(), 100, seed=1)
    assert len(lrn.plan.fragments) == tensors
    flags = ["--model", inputs["model"], "--tokenizer", inputs["tokenizer"], "--data", inputs["data"]]
    flags += ["--seq-len", str(SEQ), "--batch-size", "4"]
    with caplog.at_level("WARNING", logger="protocol.config"):
        assert main(["train-local", *flags, "--tokens", "4000", "--learners", "2", "--json"]) == 0
    assert f"fragments: {tensors}, one per parameter tensor" in caplog.text
    capsys.readouterr()
    # set by the user, a count the model cannot hold is still refused
    assert main(["train-local", *flags, "--tokens", "4000", "--fragments", "24"]) == 2
    assert f"only {tensors} parameter tensors" in capsys.readouterr().err


def write_config(path, **doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.slow
def test_a_model_that_is_not_a_causal_lm_is_refused_naming_its_config(tmp_path, capsys):
    cfg = write_config(tmp_path / "t5" / "config.json", model_type="t5", d_model=16, num_layers=1)
    with pytest.raises(ConfigError, match="is not a causal language model") as e:
        load_task(None, TaskConfig(model=ModelConfig(name=f"hf:{cfg.parent}", seq_len=SEQ)))
    assert str(cfg) in str(e.value)
    bad = write_config(tmp_path / "odd" / "config.json", model_type="no-such-model")
    assert main(["train-local", "--model", f"hf:{bad}", "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco: error: ") and str(bad) in err and "no-such-model" in err


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path, capsys):
    small = make_inputs(tmp_path, vocab=300, model_vocab=100)
    with pytest.raises(ConfigError, match="does not fit the model") as e:
        hf_task(small)
    assert small["tokenizer"] in str(e.value) and small["config"] in str(e.value)
    state = tmp_path / "state"
    argv = ["node", "--state-dir", str(state), "--model", small["model"], "--tokenizer", small["tokenizer"]]
    assert main(argv + ["--data", small["data"], "--seq-len", str(SEQ)]) == 2
    assert "does not fit the model" in capsys.readouterr().err and not state.exists()
    # bytes (256 tokens) do not fit a 100-token model either
    with pytest.raises(ConfigError, match="tokenizer bytes does not fit"):
        load_task(None, TaskConfig(data=small["data"], model=ModelConfig(name=small["model"], seq_len=SEQ)))


def test_a_hub_name_is_not_downloaded_and_the_message_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="never downloads from the Hugging Face hub"):
        load_task(None, TaskConfig(model=ModelConfig(name="hf:meta-llama/Llama-3.2-1B", seq_len=SEQ)))


def test_sharding_a_model_with_tied_embeddings_says_why_not(inputs):
    from node.learner.unit_fsdp import check_shardable

    with pytest.raises(ConfigError, match="ties parameters across modules.*tie_word_embeddings=false"):
        check_shardable(hf_task(inputs).new_model())


@pytest.mark.slow
def test_presets_pick_a_model_and_batch_and_flags_override_them():
    from node.cli.config import build_config
    from node.cli.main import _parser

    def cfg(*argv):
        return build_config(_parser(["train-local"]).parse_args(["train-local", *argv]), None)

    small = cfg("--preset", "small")
    assert (small.model.dim, small.model.layers, small.task.batch_size) == (320, 8, 16)
    n = sum(p.numel() for p in load_task(None, small.task_config()).new_model().parameters())
    assert 9e6 < n < 12e6, n
    assert cfg("--preset", "small", "--dim", "256").model.dim == 256
    big = cfg("--preset", "gpt2-125m")
    assert (big.model.name, big.model.seq_len, big.task.batch_size) == ("gpt2", 1024, 8)
    from node.learner.hf import HFModel

    gpt2 = HFModel("gpt2", big.model.seq_len, (big.model.dim, big.model.layers, big.model.heads))
    m = gpt2.new_model(0)
    assert 120e6 < sum(p.numel() for p in m.parameters()) < 130e6
    assert cfg().model == ModelConfig()  # no preset: today's default, which is the tiny preset
    assert cfg("--preset", "tiny").model == ModelConfig()


def _unit_worker(rank: int, init_file: str, out_dir: str, inputs: dict) -> None:
    from node.learner.learner import Learner
    from node.learner.unit import PAUSE, STATE, STEP, STOP, Unit
    from tests.swarm_util import exit_now

    torch.set_num_threads(1)
    unit = Unit(rank=rank, world=2, local_rank=rank, timeout_s=60, init_method=f"file://{init_file}")
    unit.init()
    task = hf_task(inputs, data_part="1/2")  # this node reads part 1 of 2; its ranks split that again
    lrn = Learner(f"r{rank}", task, ProtocolConfig(fragments=4, sync_every=4), InnerConfig(), 100, seed=3)
    lrn.attach_unit(unit)
    unit.exchange(lrn, STATE)
    losses = []
    for _ in range(6):
        unit.exchange(lrn, STEP)
        losses.append(lrn.train_step().loss)
    unit.exchange(lrn, PAUSE, check_all=True)
    unit.exchange(lrn, STOP)
    m = lrn.model
    log = {
        "mismatches": unit.mismatches,
        "losses": losses,
        "windows": [i for p in range(6) for i in lrn.reader.window_ids(p)],
        "position": lrn.data_position(),
        "tied": m.get_output_embeddings().weight is m.get_input_embeddings().weight,
        "digest": unit._digest(lrn, list(range(4))).tolist(),
    }
    unit.close()
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump(log, fh)
    exit_now()


@pytest.mark.slow
def test_a_ddp_unit_trains_the_tiny_llama_on_disjoint_halves_of_its_part(inputs, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_unit_worker, args=(str(tmp_path / "rdv"), str(tmp_path), inputs), nprocs=2, join=True)
    r = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert r[0]["mismatches"] == 0 and r[0]["digest"] == r[1]["digest"]  # the ranks stayed one model
    assert all(x["tied"] and x["position"] == 6 for x in r)
    assert not set(r[0]["windows"]) & set(r[1]["windows"])
    # part 0 of 2 (the other node) reads none of the windows this unit read
    other = hf_task(inputs, data_part="0/2")
    from node.learner.learner import Learner

    lrn = Learner("o", other, ProtocolConfig(fragments=4, sync_every=4), InnerConfig(), 100, seed=1)
    theirs = {i for p in range(12) for i in lrn.reader.window_ids(p)}
    assert not theirs & (set(r[0]["windows"]) | set(r[1]["windows"]))
    assert r[0]["losses"][-1] < r[0]["losses"][0]
