"""The CLI as a user runs it: config precedence, clear errors for bad values, a real training run."""

import json

import pytest

from node.cli.main import main

TINY = [
    "--dim",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--fragments",
    "4",
    "--sync-every",
    "8",
    "--quiet",
]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--fragments", "100"], "fragments=100"),
        (["--quorum", "9"], "quorum=9"),
        (["--overlap", "24", "--sync-every", "24"], "overlap=24"),
        (["--codec", "int3"], "codec='int3'"),
        (["--data", "/no/such/file.txt"], "data='/no/such/file.txt'"),
        (["--system", "allreduce"], "system='allreduce'"),
        (["--heads", "3"], "heads=3"),
        (["--task", "nomodule"], "task='nomodule'"),
    ],
)
def test_bad_configuration_fails_at_start_naming_the_value(argv, needle, capsys):
    assert main(["train-local", *argv]) == 2
    err = capsys.readouterr().err
    assert "ddiloco: error:" in err and needle in err
    assert "resolved configuration" not in err  # failed before doing anything


def test_toml_then_flags_precedence_and_unknown_keys(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[protocol]\nquorum = 3\nfragments = 5\n[run]\nlearners = 2\n")
    assert main(["train-local", "--config", str(cfg)]) == 2  # K=3 > M=2 from the file
    assert "quorum=3" in capsys.readouterr().err
    assert main(["train-local", "--config", str(cfg), "--learners", "3", "--tokens", "1", *TINY]) == 0
    cfg.write_text("[protocol]\nfragmnts = 5\n")
    assert main(["train-local", "--config", str(cfg)]) == 2
    assert "fragmnts" in capsys.readouterr().err
    cfg.write_text('[protocol]\nfragments = "five"\n')
    assert main(["train-local", "--config", str(cfg)]) == 2
    assert "protocol.fragments='five'" in capsys.readouterr().err


def test_train_local_learns_and_writes_events(tmp_path, capsys):
    ev = tmp_path / "ev.jsonl"
    exported = tmp_path / "final.safetensors"
    rc = main(
        [
            "train-local",
            *TINY,
            "--learners",
            "2",
            "--tokens",
            str(2 * 40 * 128),
            "--json",
            "--events",
            str(ev),
            "--export",
            str(exported),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["final_loss"] < out["initial_loss"] - 0.5
    assert out["merges"] > 0 and 0 < out["goodput"] <= 1
    kinds = {json.loads(line)["kind"] for line in ev.read_text().splitlines()}
    assert {"run", "step", "contribute", "merge", "adopt", "eval"} <= kinds
    # the exported global model is a plain state dict that loads into the model and gives the same loss
    from safetensors.torch import load_file

    from node.learner.task import evaluate, load_task
    from tests.conftest import tiny_task_config

    task = load_task(None, tiny_task_config())
    model = task.new_model()
    model.load_state_dict(load_file(str(exported)))
    assert evaluate(task, model) == pytest.approx(out["final_loss"], abs=1e-5)


CUSTOM = """
import torch
from torch import nn

class Regression:
    embedding = None
    tokens_per_batch = 32

    def __init__(self, cfg):
        self.w = torch.randn(8, generator=torch.Generator().manual_seed(3))

    def new_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def batch(self, gen):
        x = torch.randn(32, 8, generator=gen)
        return x, (x @ self.w).unsqueeze(1)

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def eval_batches(self):
        g = torch.Generator().manual_seed(99)
        return [self.batch(g) for _ in range(4)]

def make(cfg):
    return Regression(cfg)
"""


@pytest.mark.slow
def test_custom_task_from_module_function(tmp_path, monkeypatch, capsys):
    (tmp_path / "mytask_mod.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(
        [
            "train-local",
            "--task",
            "mytask_mod:make",
            "--fragments",
            "2",
            "--sync-every",
            "8",
            "--learners",
            "2",
            "--tokens",
            str(2 * 200 * 32),
            "--json",
            "--quiet",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["final_loss"] < 0.5 * out["initial_loss"]


def test_keygen_writes_an_identity_and_refuses_to_overwrite(tmp_path, capsys):
    from dht.identity import Identity

    out = tmp_path / "id.key"
    assert main(["keygen", "--out", str(out)]) == 0
    peer = capsys.readouterr().out.strip()
    assert peer == Identity.load(out).peer_id and peer.startswith("12D3KooW")
    assert main(["keygen", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert Identity.load(out).peer_id == peer  # unchanged


def test_several_systems_write_one_file_each():
    from node.cli.train_local import _per_system

    assert _per_system("./runs/ev.jsonl", "dp", True) == "runs/ev.dp.jsonl"
    assert _per_system("./runs/ev.jsonl", "dp", False) == "./runs/ev.jsonl"
    assert _per_system(None, "dp", True) is None


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--initial-peers", "/ip4/127.0.0.1/tcp/9"], "lacks the peer's /p2p/<peer id>"),
        (["--host-maddrs", "not-a-multiaddr"], "is not a valid multiaddr"),
        (["--ttl-s", "1", "--heartbeat-s", "1"], "ttl_s=1.0 is invalid"),
        (["--swarm", "a/b"], "swarm='a/b' is invalid"),
    ],
)
def test_node_refuses_bad_network_settings_with_a_clear_error(tmp_path, capsys, flags, needle):
    rc = main(["node", "--state-dir", str(tmp_path / "s"), *flags])
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_node_with_unreachable_initial_peers_says_what_it_tried(tmp_path, capsys):
    from dht.identity import Identity

    ghost = Identity.generate().peer_id
    peer = f"/ip4/127.0.0.1/tcp/9/p2p/{ghost}"  # the discard port: nothing of ours answers there
    rc = main(["node", "--state-dir", str(tmp_path / "s"), "--initial-peers", peer, "--dim", "32"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "none of the initial peers" in err and ghost in err


def test_status_without_a_running_node_says_where_it_looked(tmp_path, capsys):
    assert main(["status", "--state-dir", str(tmp_path)]) == 2
    assert "ready.json does not exist" in capsys.readouterr().err
    assert main(["status", "--url", "http://127.0.0.1:9"]) == 2
    assert "is the node running" in capsys.readouterr().err


def test_commands_that_need_no_model_start_without_torch(tmp_path):
    """``keygen`` (and every command but ``train-local`` and ``node``) runs without importing torch, which
    took 2-3 s of a 3 s ``ddiloco keygen``; ``--help`` still lists the two with the help line each has."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from node.cli.main import main\n"
        f"assert main(['keygen', '--out', {str(tmp_path / 'k.key')!r}]) == 0\n"
        "assert main(['swarm', 'init', '--dir', sys.argv[1], '--name', 's']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "auth")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_help_of_a_command_imported_late_is_its_own():
    import argparse

    from node.cli.main import COMMANDS, command_module

    for name, (_, lazy_help) in COMMANDS.items():
        if lazy_help is None:
            continue
        sub = argparse.ArgumentParser().add_subparsers()
        command_module(name).add_parser(sub)
        assert [a.help for a in sub._choices_actions] == [lazy_help], name
