"""The Docker image, the compose file and the Kubernetes pod, tested without a Docker engine.

What can be checked here: the Dockerfile's instructions (non-root, no torch in
the default target, ENTRYPOINT `ckptd run`, HEALTHCHECK `ckptd health`); the
compose and Kubernetes files parse, share the checkpoint volume between trainer
and ckptd, and set only variables ckptd knows, with values it accepts; and
the image's install steps, reproduced in a fresh virtualenv, give a `ckptd`
whose entrypoint runs with the compose file's environment and reports healthy.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ckptd import __version__
from ckptd.config.effective import KNOWN, effective_config
from tests.support.common import REPO
from tests.support.daemonproc import DaemonProc

yaml = pytest.importorskip("yaml", reason="needs PyYAML (the test extra)")


# --- the Dockerfile ----------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions, those of the stage it is built FROM first; the default target is last."""
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for keyword, rest in instructions(text):
        if keyword == "FROM":
            image, _, name = rest.partition(" AS ")
            current = [*result.get(image.strip(), []), (keyword, rest)]
            result[name.strip() or f"stage{len(result)}"] = current
        else:
            current.append((keyword, rest))
    return result


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            env.update(token.split("=", 1) for token in shlex.split(rest))
    return env


def last(stage: list[tuple[str, str]], keyword: str) -> str:
    return [rest for k, rest in stage if k == keyword][-1]


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, list[tuple[str, str]]]:
    return stages((REPO / "Dockerfile").read_text())


def test_the_default_image_is_slim_nonroot_and_checks_its_health(dockerfile):
    default = list(dockerfile.values())[-1]
    assert last(default, "FROM").startswith("base AS") and dockerfile["base"][0][1].startswith("python:3.11-slim ")
    assert json.loads(last(default, "ENTRYPOINT")) == ["ckptd", "run"]
    healthcheck = last(default, "HEALTHCHECK")
    assert json.loads(healthcheck[healthcheck.index("CMD ") + 4:]) == ["ckptd", "health"]
    assert last(default, "USER") not in ("root", "0")
    runs = " ".join(rest for k, rest in default if k == "RUN")
    assert "torch" not in runs and "deepspeed" not in runs  # the size of the default image
    assert env_of(default)["CKPTD_STATE_DIR"] == "/var/lib/ckptd"


def test_the_deepspeed_target_pins_the_torch_the_project_pins(dockerfile):
    runs = " ".join(rest for k, rest in dockerfile["deepspeed"] if k == "RUN")
    pyproject = (REPO / "pyproject.toml").read_text()
    [pin] = [w for w in shlex.split(runs) if w.startswith("torch==")]
    assert f'"{pin}"' in pyproject  # the deepspeed extra's pin
    assert "--index-url" in runs and ".[deepspeed,metrics,kubernetes]" in runs
    assert last(dockerfile["deepspeed"], "USER") == "ckptd"


# --- compose and Kubernetes ------------------------------------------------------


def check_environment(env: dict[str, str]) -> None:
    assert set(env) <= KNOWN, f"not ckptd variables: {set(env) - KNOWN}"
    config = effective_config(None, env)  # raises ConfigError on a value ckptd would refuse
    assert config.roots and config.daemon.metrics_listen


def test_compose_shares_the_volume_and_runs_the_image(dockerfile):
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    trainer, ckptd = doc["services"]["trainer"], doc["services"]["ckptd"]
    assert ckptd["build"] == "." and (REPO / "Dockerfile").is_file()
    assert "command" not in ckptd and "entrypoint" not in ckptd  # the image's `ckptd run`
    assert ckptd["healthcheck"]["test"] == ["CMD", "ckptd", "health"]
    env = {k: str(v) for k, v in ckptd["environment"].items()}
    check_environment(env)
    mounts = {m.split(":")[0]: m.split(":")[1] for m in ckptd["volumes"]}
    shared = [m.split(":") for m in trainer["volumes"]]
    assert [(name, target) for name, target in shared if mounts.get(name) == target] == [
        ("checkpoints", env["CKPTD_ROOTS"])
    ]
    assert "checkpoints" in doc["volumes"]
    assert mounts["ckptd-state"] == env_of(list(dockerfile.values())[-1])["CKPTD_STATE_DIR"]
    assert ckptd["user"] == trainer["user"]  # so ckptd may delete what the trainer wrote
    assert "save_total_limit" not in " ".join(trainer["command"])
    # the trainer's image is the user's to name: compose refuses to start without it, never pulls a placeholder
    assert re.fullmatch(r"\$\{TRAINER_IMAGE:\?[^}]+\}", trainer["image"]), trainer["image"]
    # a new named volume is root's: a one-off service hands it to the uid:gid both run as, first
    init = doc["services"]["volume-init"]
    uid_gid = trainer["user"]
    assert init["command"] == ["chown", uid_gid, env["CKPTD_ROOTS"]] and init["user"] == "0:0"
    assert init["volumes"] == [f"checkpoints:{env['CKPTD_ROOTS']}"]
    assert ckptd["depends_on"] == {"volume-init": {"condition": "service_completed_successfully"}}
    # the trainer waits for a healthy ckptd (its first scan done), not only for it to start
    assert trainer["depends_on"] == {"volume-init": {"condition": "service_completed_successfully"},
                                     "ckptd": {"condition": "service_healthy"}}


@pytest.mark.parametrize("name", ["Dockerfile", "docker-compose.yml", "k8s/ckptd-sidecar.yaml"])
def test_no_example_sets_a_world_size(name):
    """CKPTD_WORLD_SIZE=8 on a 4-rank DDP job held every checkpoint "incomplete (4/8 ranks)"
    forever: nothing deleted, the disk full. A world size belongs to one job, not to an example."""
    text = (REPO / name).read_text()
    assert "CKPTD_WORLD_SIZE" not in text and "world_size = " not in text


def test_kubernetes_sidecar_meets_pod_security_restricted():
    """The fields Pod Security Admission checks at level "restricted" (pod-security-standards,
    "Restricted" table, as of Kubernetes 1.30), for the pod and every container in it."""
    docs = list(yaml.safe_load_all((REPO / "k8s" / "ckptd-sidecar.yaml").read_text()))
    [pod] = [d for d in docs if d["kind"] == "Pod"]
    spec = pod["spec"]
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc.get("runAsUser", 1) != 0
    assert pod_sc["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    # volume types allowed under restricted; never hostPath
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
               "projected", "secret"}
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= allowed, volume
    containers = [*spec.get("initContainers", []), *spec["containers"]]
    assert {c["name"] for c in containers} == {"ckptd", "trainer"}
    for c in containers:
        sc = c.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
        assert set(sc.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}, c["name"]
        assert not sc.get("privileged") and sc.get("runAsNonRoot", True) is not False, c["name"]
        assert sc.get("runAsUser", pod_sc.get("runAsUser")) != 0, c["name"]
        seccomp = sc.get("seccompProfile", pod_sc["seccompProfile"])
        assert seccomp["type"] in ("RuntimeDefault", "Localhost"), c["name"]
        assert "hostPort" not in str(c.get("ports", [])), c["name"]


def test_kubernetes_sidecar_shares_the_pvc_with_the_trainer():
    docs = list(yaml.safe_load_all((REPO / "k8s" / "ckptd-sidecar.yaml").read_text()))
    [pvc] = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    [pod] = [d for d in docs if d["kind"] == "Pod"]
    spec = pod["spec"]
    [ckptd] = [c for c in spec["initContainers"] if c["name"] == "ckptd"]
    [trainer] = spec["containers"]
    assert ckptd["restartPolicy"] == "Always"  # a native sidecar
    # the image built from this tree, by version: a `:latest` image is always pulled, from nowhere
    assert ckptd["image"] == f"ckptd:{__version__}" and ckptd["imagePullPolicy"] == "IfNotPresent"
    assert f"docker build -t ckptd:{__version__} ." in (REPO / "docs" / "deployment" / "kubernetes.md").read_text()
    assert ckptd["command"] == ["ckptd", "run"]
    for probe in ("startupProbe", "livenessProbe"):
        assert ckptd[probe]["exec"]["command"] == ["ckptd", "health"]
    env = {e["name"]: e["value"] for e in ckptd["env"]}
    check_environment(env)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mine = {m["name"]: m["mountPath"] for m in ckptd["volumeMounts"]}
    theirs = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    [(shared, path)] = [(n, p) for n, p in mine.items() if theirs.get(n) == p]
    assert path == env["CKPTD_ROOTS"]
    assert volumes[shared]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert ckptd["securityContext"]["readOnlyRootFilesystem"] and "ckptd-state" in mine  # state on a volume
    assert spec["securityContext"]["runAsUser"] != 0


# --- the image's install steps, in a fresh virtualenv ---------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.network
def test_the_image_install_steps_give_a_ckptd_whose_entrypoint_runs(tmp_path, dockerfile):
    """COPY and RUN pip of the default target, replayed into a fresh venv (pip's own config, so
    an offline index works too); then the entrypoint, with the compose file's environment."""
    default = list(dockerfile.values())[-1]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    workdir = tmp_path / "src"  # WORKDIR /src, filled by the COPY lines
    workdir.mkdir()
    for keyword, rest in default:
        if keyword == "COPY":
            *sources, dest = shlex.split(rest)
            for source in sources:
                target = workdir / dest / Path(source).name if dest.endswith("/") else workdir / dest
                if (REPO / source).is_dir():
                    shutil.copytree(REPO / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
                else:
                    shutil.copy(REPO / source, target)
    empty = tmp_path / "empty"  # shadows the PYTHONPATH the tests run with: the installed copy must work
    empty.mkdir()
    env = {**os.environ, **env_of(default), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(empty)}
    env = {k: v for k, v in env.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET", "VIRTUAL_ENV")}
    pip_runs = [rest for k, rest in default if k == "RUN" and rest.startswith("pip ")]
    assert pip_runs
    for command in pip_runs:
        proc = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], env=env, capture_output=True).returncode != 0
    ckptd = str(venv / "bin" / "ckptd")
    version = subprocess.run([ckptd, "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("ckptd ")

    # the compose file's environment, with its paths and port moved here
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["ckptd"]
    port = free_port()
    state = tmp_path / "state"
    env.update({k: str(v) for k, v in compose["environment"].items()})
    env.update({"CKPTD_ROOTS": str(tmp_path / "checkpoints"), "CKPTD_STATE_DIR": str(state),
                "CKPTD_METRICS_LISTEN": f"127.0.0.1:{port}"})
    (tmp_path / "checkpoints").mkdir()
    _, program, *args = compose["healthcheck"]["test"]  # ["CMD", "ckptd", "health"]
    health = [str(venv / "bin" / program), *args]
    proc = subprocess.run(health, env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (1, f"unhealthy: no ckptd state file in {state}\n")

    entrypoint = json.loads(last(default, "ENTRYPOINT"))
    entrypoint[0] = str(venv / "bin" / entrypoint[0])
    with DaemonProc(env=env, command=entrypoint) as daemon:  # logs JSON: CKPTD_LOG_FORMAT from compose
        daemon.wait_message("ready", timeout=60)
        proc = subprocess.run(health, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith(f"healthy: pid {daemon.proc.pid}, "), proc.stdout
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert f'ckptd_checkpoints{{root="{tmp_path / "checkpoints"}",state="complete"}} 0.0' in resp.read().decode()
        assert daemon.stop() == 0
