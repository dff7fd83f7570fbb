"""The container deployment, checked statically: Dockerfile, docker-compose.yml, deploy/*.toml, deploy/*.sh,
and the ``monitoring`` profile (Prometheus and Grafana: deploy/prometheus.yml, deploy/grafana*).

No Docker engine is needed. The compose file is read with PyYAML, every node config goes through the node's
own ``build_config``, the entrypoint script runs under ``sh`` with stand-ins for ``ddiloco`` and ``python``,
and ``docker compose config`` runs only where the client and its compose plugin are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from dht.identity import Identity
from node.cli.config import build_config
from node.learner.model import TinyGPT
from node.swarm.settings import NodeConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
NODES = ["bootstrap", "dc1", "dc2", "dc3", "dc4"]
DCS = NODES[1:]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


# ------------------------------------------------------------------------------------------------ readers
def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _services() -> dict[str, dict]:
    """The node services (those in no profile: ``docker compose up`` starts them)."""
    return {k: v for k, v in _compose()["services"].items() if not v.get("profiles")}


def _monitoring() -> dict[str, dict]:
    return {k: v for k, v in _compose()["services"].items() if "monitoring" in v.get("profiles", [])}


def _default(value: str) -> str:
    """Compose interpolation as seen without an environment: ``${VAR:-default}`` -> ``default``."""

    def sub(m: re.Match) -> str:
        assert m.group(2) is not None, f"{m.group(0)} has no default; the compose file must work without .env"
        return m.group(2)

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", sub, value)


def _volumes(svc: dict) -> list[tuple[str, str, str]]:
    """Short-syntax volumes as (source, target, mode)."""
    out = []
    for v in svc.get("volumes", []):
        assert isinstance(v, str), f"use the short volume syntax SOURCE:TARGET[:MODE], got {v!r}"
        src, dst, *mode = v.split(":")
        out.append((src, dst, mode[0] if mode else "rw"))
    return out


def _config_path(svc: dict) -> str:
    cmd = svc["command"]
    assert isinstance(cmd, list) and cmd[0] == "node", f"command must be the exec form ['node', ...]: {cmd}"
    assert "--config" in cmd, f"command {cmd} names no --config file"
    return cmd[cmd.index("--config") + 1]


def _node_config(name: str) -> NodeConfig:
    return build_config(argparse.Namespace(), str(DEPLOY / f"{name}.toml"), root=NodeConfig)


def _maddr(s: str) -> dict[str, str]:
    """'/dns4/x/tcp/1' -> {'dns4': 'x', 'tcp': '1'} (the node parses these with hivemind's Multiaddr)."""
    parts = s.split("/")
    assert parts[0] == "" and len(parts) % 2 == 1, f"{s!r} is not a /proto/value/... multiaddr"
    return dict(zip(parts[1::2], parts[2::2]))


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        line = (buf + line).strip()
        buf = ""
        if line:
            instr, _, rest = line.partition(" ")
            out.append((instr.upper(), rest.strip()))
    return out


def _instr(name: str) -> list[str]:
    return [rest for instr, rest in _dockerfile() if instr == name]


def _args() -> dict[str, str]:
    out = {}
    for rest in _instr("ARG"):
        k, _, v = rest.partition("=")
        out[k] = v
    return out


# ------------------------------------------------------------------------------------------------ compose
def test_five_node_services_from_one_image():
    services = _services()
    assert sorted(services) == sorted(NODES)
    images = {s["image"] for s in services.values()}
    builds = {json.dumps(s.get("build"), sort_keys=True) for s in services.values()}
    assert len(images) == 1 and len(builds) == 1, "every node must run the same image, built the same way"
    build = services["bootstrap"]["build"]
    assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).is_file()


def test_each_node_mounts_its_own_config_read_only():
    for name, svc in _services().items():
        target = _config_path(svc)
        mounts = [(src, mode) for src, dst, mode in _volumes(svc) if dst == target]
        assert mounts == [(f"./deploy/{name}.toml", "ro")], (
            f"{name}: {target} must be ./deploy/{name}.toml:ro"
        )
        assert (DEPLOY / f"{name}.toml").is_file()
    used = {f"{name}.toml" for name in _services()}
    assert {p.name for p in DEPLOY.glob("*.toml")} == used, "a deploy/*.toml that no service mounts"


def test_mounts_exist_and_state_is_private():
    compose = _compose()
    declared = set(compose.get("volumes") or {})
    writers: dict[str, list[str]] = {}
    for name, svc in _services().items():
        cfg = _node_config(name)
        targets = {dst for _, dst, _ in _volumes(svc)}
        assert cfg.node.state_dir in targets, f"{name}: state_dir {cfg.node.state_dir} is not on a volume"
        for src, dst, mode in _volumes(svc):
            assert mode in ("ro", "rw"), f"{name}: mode {mode!r} of {dst}"
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"{name}: host path {src} does not exist"
            else:
                assert src in declared, f"{name}: named volume {src} is not declared under volumes:"
                if mode == "rw":
                    writers.setdefault(src, []).append(name)
    for vol, names in writers.items():
        assert len(names) == 1, f"volume {vol} is writable by {names}; each node's state must be its own"


def test_deploy_configs_are_valid_and_agree():
    cfgs = {name: _node_config(name) for name in NODES}
    tensors = len(list(TinyGPT(cfgs["bootstrap"].model).parameters()))  # 0.9M parameters: milliseconds
    for name, cfg in cfgs.items():
        cfg.protocol.check_swarm(1, tensors)  # what Node() checks at start-up
        assert cfg.node.swarm == cfgs["bootstrap"].node.swarm, f"{name} is in another swarm"
        for section in ("protocol", "task", "model", "inner"):
            assert getattr(cfg, section) == getattr(cfgs["bootstrap"], section), (
                f"[{section}] of deploy/{name}.toml differs from deploy/bootstrap.toml; one swarm, one model"
            )
        assert not cfg.node.client_mode and not cfg.node.test_hooks
        assert cfg.task.data is None or cfg.task.data.startswith("/"), "a data file must be a mounted path"


def test_addresses_name_the_services():
    for name in NODES:
        s = _node_config(name).node
        hosts = [_maddr(a) for a in s.split(s.host_maddrs)]
        announces = [_maddr(a) for a in s.split(s.announce_maddrs)]
        assert hosts == [{"ip4": "0.0.0.0", "tcp": hosts[0]["tcp"]}], (
            f"{name}: listen on 0.0.0.0, one TCP port"
        )
        assert announces == [{"dns4": name, "tcp": hosts[0]["tcp"]}], (
            f"{name}: announce /dns4/{name}/tcp/<its listen port> so peers reach it by service name"
        )


def test_dc_nodes_bootstrap_from_the_bootstrap_service():
    services = _services()
    boot, boot_cfg = services["bootstrap"], _node_config("bootstrap").node
    assert boot_cfg.initial_peers == "", "the bootstrap starts the swarm"
    published = boot["environment"]["DDILOCO_PUBLISH_PEER_ID"]
    peer_dir = os.path.dirname(published)
    (peer_vol,) = [src for src, dst, mode in _volumes(boot) if dst == peer_dir and mode == "rw"]
    boot_port = _maddr(boot_cfg.host_maddrs)["tcp"]
    for name in DCS:
        svc = services[name]
        env = svc["environment"]
        assert "DDILOCO_PUBLISH_PEER_ID" not in env
        assert env["DDILOCO_BOOTSTRAP_PEER_FILE"] == published
        assert (peer_vol, peer_dir, "ro") in _volumes(svc), f"{name} must mount {peer_vol} at {peer_dir}:ro"
        assert _maddr(env["DDILOCO_BOOTSTRAP"]) == {"dns4": "bootstrap", "tcp": boot_port}
        assert svc["depends_on"] == {"bootstrap": {"condition": "service_healthy"}}
        assert _node_config(name).node.initial_peers == "", f"{name}: the entrypoint sets --initial-peers"


def test_healthchecks_restarts_and_ports():
    published = []
    for name, svc in _services().items():
        s = _node_config(name).node
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], f"{name}: healthcheck must run python (no curl in slim)"
        compile(test[3], f"{name} healthcheck", "exec")
        urls = re.findall(r"http://[^'\"]+", test[3])
        assert urls == [f"http://127.0.0.1:{s.status_port}/status"], f"{name}: healthcheck reads {urls}"
        assert s.status_host in ("127.0.0.1", "0.0.0.0"), f"{name}: the healthcheck needs loopback"
        assert svc["restart"] == "unless-stopped" and svc["init"] is True
        m = re.fullmatch(r"(\d+)s", svc["stop_grace_period"])
        assert m and int(m.group(1)) >= 30, f"{name}: leave time for the final checkpoint after SIGTERM"
        for p in svc.get("ports", []):
            ip, host_port, container_port = str(p).split(":")
            assert ip == "127.0.0.1", f"{name}: {p} must be bound to the host's loopback only"
            assert int(container_port) == s.status_port and s.status_host == "0.0.0.0", (
                f"{name}: {p} publishes a port the status endpoint does not serve on the container's address"
            )
            published.append(int(host_port))
    assert published and len(published) == len(set(published)), f"host ports {published} must be unique"
    assert _services()["bootstrap"].get("ports"), "the bootstrap's status endpoint is published"


def test_docker_compose_config_when_available(tmp_path):
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=20)
    if probe.returncode != 0:
        pytest.skip("docker client without the compose plugin")
    r = subprocess.run(
        [docker, "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------------ monitoring
def test_monitoring_profile_adds_prometheus_and_grafana_only():
    every = _compose()["services"]
    mon = _monitoring()
    assert sorted(mon) == ["grafana", "prometheus"]
    assert set(every) == set(NODES) | set(mon), "every other service is a node, outside any profile"
    for name, svc in mon.items():
        assert svc["profiles"] == ["monitoring"]
        assert re.fullmatch(r"[\w./-]+:v?\d+(\.\d+)+", svc["image"]), f"{name}: pin the image version"
        for p in svc.get("ports", []):
            assert str(p).startswith("127.0.0.1:"), f"{name}: {p} must be bound to the host's loopback only"
        for src, _, mode in _volumes(svc):
            assert mode == "ro" and (ROOT / src).is_file(), f"{name}: {src} must be a file mounted read-only"


def _mount(svc: dict, target_dir: str, suffix: str = "") -> Path:
    """The host file a service mounts under target_dir."""
    (src,) = [src for src, dst, _ in _volumes(svc) if dst.startswith(target_dir) and dst.endswith(suffix)]
    return ROOT / src


def test_prometheus_scrapes_every_node_status_port():
    prom = _monitoring()["prometheus"]
    conf = yaml.safe_load(_mount(prom, "/etc/prometheus/prometheus.yml").read_text())
    (job,) = conf["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    want = [f"{name}:{_node_config(name).node.status_port}" for name in NODES]
    assert sorted(targets) == sorted(want), "one target per node service, at its status port"
    for name in NODES:
        assert _node_config(name).node.status_host == "0.0.0.0", (
            f"{name}: Prometheus reaches it over the compose network only if it listens on 0.0.0.0"
        )


def test_grafana_provisions_the_dashboard_and_its_queries_name_exported_metrics():
    from prometheus_client.registry import CollectorRegistry

    from node.swarm.metrics import NodeMetrics

    graf = _monitoring()["grafana"]
    source = yaml.safe_load(_mount(graf, "/etc/grafana/provisioning/datasources").read_text())
    (ds,) = source["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load(_mount(graf, "/etc/grafana/provisioning/dashboards").read_text())
    folder = provider["providers"][0]["options"]["path"]
    dash = json.loads(_mount(graf, folder, ".json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all(t["datasource"]["uid"] == ds["uid"] for p in dash["panels"] for t in p["targets"])

    # what a node exports: sample names of a registry fed a status document of the real shape
    doc = {
        "peer_id": "p", "swarm": "s", "learner": {"steps": 1, "tokens": 1, "tokens_per_s": 1.0, "loss": 1.0,
        "eval_loss": 1.0, "paused": False}, "rounds_merged": 1, "tokens_merged": 1.0, "goodput": 0.5,
        "in_flight": 0, "uptime_s": 1.0, "cpu": {"process_s": 2.0, "learner_s": 1.0}, "peers": [{"reachable": True}], "bytes_sent": 1, "bytes_received": 1,
        "fragments": [{"fragment": 0, "round": 1, "synchroniser": "p"}],
        "counters": {"failovers": 0, "forks": 0}, "refused": {"malformed": 1},
    }  # fmt: skip
    registry: CollectorRegistry = NodeMetrics("p", lambda: doc).registry
    exported = {s.name for fam in registry.collect() for s in fam.samples}
    for e in exprs:
        names = set(re.findall(r"\bddiloco_\w+", e))
        assert names, f"query {e!r} names no ddiloco metric"
        for n in names:
            assert n in exported or f"{n}_total" in exported, f"query {e!r}: the node exports no {n}"


# ------------------------------------------------------------------------------------------------ image
def test_dockerfile_installs_this_project():
    base = _instr("FROM")
    assert len(base) == 1
    m = re.fullmatch(r"python:(\d+\.\d+)-slim", base[0])
    assert m, f"base image {base[0]}"
    assert m.group(1) + ".0" in SpecifierSet(PYPROJECT["project"]["requires-python"])

    args = _args()
    torch_req = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch"))
    pinned = Requirement(args["TORCH_SPEC"])
    assert pinned.name == "torch" and str(pinned.specifier).startswith("==")
    assert str(pinned.specifier)[2:] in torch_req.specifier, (
        f"{pinned} does not satisfy pyproject's {torch_req}"
    )
    assert args["TORCH_SPEC"] in (ROOT / "scripts" / "setup.sh").read_text(), "same torch as scripts/setup.sh"
    build_args = _services()["bootstrap"]["build"]["args"]
    assert {k: _default(v) for k, v in build_args.items()} == {k: args[k] for k in build_args}

    runs = " && ".join(_instr("RUN"))
    assert 'pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"' in runs
    assert re.search(r"pip install \.( |$)", runs), "the image must pip-install this repository"

    copied = {}
    for rest in _instr("COPY"):
        *srcs, dst = rest.split()
        for src in srcs:
            copied[src.rstrip("/")] = dst
    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    for needed in ["pyproject.toml", PYPROJECT["project"]["readme"], *packages]:
        assert needed in copied, f"the Dockerfile does not COPY {needed}, which 'pip install .' needs"
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"


def test_entrypoint_runs_ddiloco_with_the_compose_command():
    (entrypoint,) = _instr("ENTRYPOINT")
    (cmd,) = _instr("CMD")
    entrypoint, cmd = json.loads(entrypoint), json.loads(cmd)
    copied = {rest.split()[-1]: rest.split()[0] for rest in _instr("COPY")}
    assert copied.get(f"/usr/local/bin/{entrypoint[0]}") == "deploy/entrypoint.sh"
    script = (DEPLOY / "entrypoint.sh").read_text()
    assert script.rstrip().endswith('exec ddiloco "$@"')
    assert copied.get("/usr/local/lib/ddiloco/peer_id.py") == "deploy/peer_id.py"
    assert "/usr/local/lib/ddiloco/peer_id.py" in script
    assert os.access(DEPLOY / "entrypoint.sh", os.X_OK)
    for name, svc in _services().items():
        assert svc["command"] == cmd, f"{name}: command differs from the image's CMD {cmd}"
        assert "entrypoint" not in svc
    expose = {int(p) for rest in _instr("EXPOSE") for p in rest.split()}
    for name in NODES:
        s = _node_config(name).node
        assert {int(_maddr(s.host_maddrs)["tcp"]), s.status_port} <= expose


def test_dockerignore_keeps_local_state_out_and_sources_in():
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and p[0] != "#"
    ]
    assert not any(p.startswith("!") for p in patterns)

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for pat in patterns:
            if pat.startswith("**/"):
                if any(fnmatch(part, pat[3:]) for part in parts):
                    return True
            elif any(fnmatch(pre, pat.strip("/")) for pre in prefixes):
                return True
        return False

    for local in [".venv", ".git", "runs", "node/__pycache__/x.pyc", ".pytest_cache", "ddiloco.egg-info"]:
        assert ignored(local), f".dockerignore lets {local} into the build context"
    for rest in _instr("COPY"):
        for src in rest.split()[:-1]:
            assert not ignored(src.rstrip("/")), f".dockerignore excludes {src}, which the Dockerfile copies"


# ------------------------------------------------------------------------------------------------ scripts
@pytest.fixture
def fake_bin(tmp_path):
    """A PATH where ``ddiloco`` prints its arguments and ``python`` prints a peer id."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "ddiloco").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (d / "python").write_text("#!/bin/sh\necho 12D3KooWPublishedPeerId\n")
    for f in d.iterdir():
        f.chmod(0o755)
    return d


def _entrypoint(fake_bin: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", **env}
    return subprocess.run(
        ["sh", str(DEPLOY / "entrypoint.sh"), *argv], env=env, capture_output=True, text=True, timeout=10
    )


def test_entrypoint_appends_the_bootstrap_as_initial_peer(fake_bin, tmp_path):
    peer = tmp_path / "bootstrap.peer"
    peer.write_text("12D3KooWBootstrapPeerId\n")
    env = {"DDILOCO_BOOTSTRAP": "/dns4/bootstrap/tcp/31337", "DDILOCO_BOOTSTRAP_PEER_FILE": str(peer)}
    r = _entrypoint(fake_bin, env, "node", "--config", "/etc/ddiloco/node.toml")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "node",
        "--config",
        "/etc/ddiloco/node.toml",
        "--initial-peers",
        "/dns4/bootstrap/tcp/31337/p2p/12D3KooWBootstrapPeerId",
    ]
    env["DDILOCO_BOOTSTRAP_PEER_FILE"], env["DDILOCO_WAIT_S"] = str(tmp_path / "missing.peer"), "0"
    r = _entrypoint(fake_bin, env, "node")
    assert r.returncode == 1 and "no bootstrap peer id" in r.stderr


def test_entrypoint_publishes_the_peer_id(fake_bin, tmp_path):
    out = tmp_path / "peer" / "bootstrap.peer"
    r = _entrypoint(fake_bin, {"DDILOCO_PUBLISH_PEER_ID": str(out), "DDILOCO_PEER_ID_SCRIPT": "x"}, "node")
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "12D3KooWPublishedPeerId\n"
    assert r.stdout.splitlines() == ["node"]
    r = _entrypoint(fake_bin, {"DDILOCO_BOOTSTRAP": "/dns4/x/tcp/1"}, "keygen", "--out", "k")
    assert r.stdout.splitlines() == ["keygen", "--out", "k"], "only `node` gets initial peers"


def test_peer_id_helper_follows_the_node_identity_rule(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("deploy_peer_id", DEPLOY / "peer_id.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = ["node", "--config", str(DEPLOY / "bootstrap.toml"), "--state-dir", str(tmp_path)]
    assert mod.main(argv) == 0
    first = capsys.readouterr().out.strip()
    assert first == Identity.load(tmp_path / "identity.key").peer_id
    assert mod.main(argv) == 0 and capsys.readouterr().out.strip() == first, "an existing key is kept"
    key = tmp_path / "other.key"
    assert mod.main([*argv, "--identity", str(key)]) == 0
    assert capsys.readouterr().out.strip() == Identity.load(key).peer_id != first
    assert mod.main(["node", "--config", str(tmp_path / "nope.toml")]) == 2
