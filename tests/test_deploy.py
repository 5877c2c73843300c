"""Deployment files, checked offline by the real validators, and the preflight on a real small tmpfs."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from app.loader.plan import Rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "deploy", "k8s")


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def compose():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        return yaml.safe_load(f)


# -- compose ----------------------------------------------------------------------------------------------

def test_docker_compose_accepts_the_compose_file():
    out = subprocess.run(["docker-compose", "--env-file", ".env.example", "-f", "compose.yaml", "config", "-q"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_sampler_donates_a_sized_shm_that_the_trainer_joins():
    services = compose()["services"]
    sampler, trainer = services["sampler"], services["trainer"]
    assert sampler["ipc"] == "shareable" and sampler["shm_size"].startswith("${FEEDLINE_SHM_SIZE")
    assert trainer["ipc"] == "service:sampler"
    assert trainer["depends_on"]["sampler"]["condition"] == "service_healthy"
    device = trainer["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert services["dcgm-exporter"]["profiles"] == ["dcgm"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in services["grafana"]["volumes"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]


def test_env_example_sets_every_knob_compose_reads():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        used = set(re.findall(r"\$\{(FEEDLINE_[A-Z_]+)", f.read()))
    with open(os.path.join(ROOT, ".env.example")) as f:
        given = set(re.findall(r"^(FEEDLINE_[A-Z_]+)=", f.read(), re.M))
    assert used <= given, used - given


# -- Kubernetes -------------------------------------------------------------------------------------------

def test_kubernetes_validate_strict_accepts_every_manifest():
    files = sorted(os.path.join(K8S, f) for f in os.listdir(K8S) if f.endswith(".yaml"))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", *files], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed for resource pod/feedline" in out.stdout + out.stderr


def test_the_pod_runs_the_sampler_as_a_native_sidecar_over_a_memory_emptydir():
    pod = load_all(os.path.join(K8S, "pod.yaml"))[0]["spec"]
    sampler = pod["initContainers"][0]
    trainer = pod["containers"][0]
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert sampler["restartPolicy"] == "Always" and sampler["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert dshm["emptyDir"]["medium"] == "Memory" and dshm["emptyDir"]["sizeLimit"]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e.get("value") for e in sampler["env"]}
    budget = float(env["FEEDLINE_BUDGET"].rstrip("GiB"))
    assert float(sampler["resources"]["limits"]["memory"].rstrip("Gi")) > budget  # tmpfs pages charged here
    for c in (sampler, trainer):
        assert {"mountPath": "/dev/shm", "name": "dshm"} in c["volumeMounts"]


def test_the_podmonitor_scrapes_both_named_ports():
    mon = load_all(os.path.join(K8S, "podmonitor.yaml"))[0]
    pod = load_all(os.path.join(K8S, "pod.yaml"))[0]
    assert mon["kind"] == "PodMonitor"
    assert mon["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"] for p in c["ports"]}
    assert {e["port"] for e in mon["spec"]["podMetricsEndpoints"]} <= ports


def test_the_multinode_job_partitions_the_source_per_node():
    service, job = load_all(os.path.join(K8S, "multinode.yaml"))
    assert service["spec"]["clusterIP"] == "None"
    assert job["spec"]["completionMode"] == "Indexed"
    spec = job["spec"]["template"]["spec"]
    assert spec["subdomain"] == service["metadata"]["name"]
    env = {e["name"]: e for e in spec["initContainers"][0]["env"]}
    assert "job-completion-index" in env["FEEDLINE_PARTITION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert int(env["FEEDLINE_PARTITION_COUNT"]["value"]) == job["spec"]["completions"]
    trainer_env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert trainer_env["FEEDLINE_RANK_SCOPE"] == "local"


def test_a_local_rank_scope_splits_by_local_rank(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Rank.detect() == Rank(5, 8)
    assert Rank.detect(local=True) == Rank(1, 4)


# -- the Dockerfile ---------------------------------------------------------------------------------------

def _stages():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    parts = re.split(r"^FROM ", text, flags=re.M)
    return text, {p.split()[2] if " AS " in p.split("\n")[0] else "": p for p in parts[1:]}


def test_the_dockerfile_builds_pillow_simd_apart_and_ships_no_build_tools():
    text, stages = _stages()
    assert set(stages) == {"build", "runtime"}
    assert re.search(r"^ARG BASE_IMAGE=.*cuda", text, re.M) and re.search(r"^ARG AVX2=0$", text, re.M)
    assert "build-essential" in stages["build"] and "build-essential" not in stages["runtime"]
    assert "--no-binary pillow-simd" in stages["build"]
    runtime = stages["runtime"]
    assert "pip uninstall -y pillow" in runtime and "check_feature('libjpeg_turbo')" in runtime
    assert 'ENTRYPOINT ["tini", "--", "feedline"]' in runtime and "tini" in runtime.split("ENTRYPOINT")[0]
    assert re.search(r"^USER feedline$", runtime, re.M) and "STOPSIGNAL SIGTERM" in runtime
    assert "HEALTHCHECK" in runtime and "/healthz" in runtime


# -- preflight on a real small tmpfs ----------------------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip()})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_doctor_names_shm_size_and_sizelimit_when_the_budget_does_not_fit(small_tmpfs):
    out = subprocess.run([sys.executable, "-m", "app.cli", "doctor", "--cache", str(small_tmpfs / "feedline"),
                          "--budget", "256MiB"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 1
    assert "FAIL" in text and "64.0 MiB in all" in text
    assert "shm_size" in text and "sizeLimit" in text


def test_doctor_passes_a_budget_that_fits(small_tmpfs):
    out = subprocess.run([sys.executable, "-m", "app.cli", "doctor", "--cache", str(small_tmpfs / "feedline"),
                          "--budget", "16MiB", "--fetch-threads", "1", "--batch-size", "8"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert "FAIL" not in out.stdout + out.stderr
    assert out.returncode == 0


def test_the_sampler_refuses_to_start_into_a_bus_error(small_tmpfs, tmp_path):
    from helpers import id_shards

    id_shards(str(tmp_path / "remote"), shards=2, per_shard=5)
    out = subprocess.run([sys.executable, "-m", "app.cli", "sample", "--source", str(tmp_path / "remote"),
                          "--cache", str(small_tmpfs / "feedline"), "--budget", "256MiB", "--metrics-port", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    text = " ".join(out.stderr.split())
    assert out.returncode == 2
    assert "--budget" in text and "shm_size" in text and "sizeLimit" in text


def test_podman_smoke_script_exists_and_says_when_it_skips():
    script = os.path.join(ROOT, "scripts", "container-smoke")
    assert os.access(script, os.X_OK)
    with open(script) as f:
        text = f.read()
    assert "SKIPPED" in text and "--ipc shareable" in text and '--ipc "container:' in text
    assert shutil.which("bash")
