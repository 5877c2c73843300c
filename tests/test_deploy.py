"""Deployment files, checked offline by the real validators, and the preflight on a real small tmpfs."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

from feedline.loader.plan.rank import Rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "deploy", "k8s")
SECRET_EXAMPLE = os.path.join(ROOT, "deploy", "secrets", "store-secret.yaml")  # not read by `apply -f deploy/k8s/`


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def compose():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        return yaml.safe_load(f)


# -- compose ----------------------------------------------------------------------------------------------

def resolved(*args, env_file=".env.example", env=None):
    """What docker-compose (Debian's, offline) makes of compose.yaml: the services as they would run."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FEEDLINE_", "AWS_"))} | (env or {})
    files = ["--env-file", env_file] if env_file else []
    with tempfile.TemporaryDirectory() as empty:  # no .env next to the project: only what is given
        shutil.copy(os.path.join(ROOT, "compose.yaml"), empty)
        for d in ("examples", "deploy", "grafana"):
            os.symlink(os.path.join(ROOT, d), os.path.join(empty, d))
        given = [os.path.join(ROOT, f) if f.startswith(".env") else f for f in files]
        out = subprocess.run(["docker-compose", *given, "-f", "compose.yaml", *args, "config"], cwd=empty,
                             capture_output=True, text=True, env=clean)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_docker_compose_accepts_the_compose_file():
    out = subprocess.run(["docker-compose", "--env-file", ".env.example", "-f", "compose.yaml", "config", "-q"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_compose_resolves_with_env_example_to_the_users_source_and_the_demo_training():
    services = resolved()["services"]
    # `config` lists every service; these two start only with their profile
    assert services["demo-store"]["profiles"] == ["demo"] and services["dcgm-exporter"]["profiles"] == ["dcgm"]
    assert services["sampler"]["environment"]["FEEDLINE_SOURCE"].startswith("https://storage.example.com/")
    trainer = services["trainer"]
    assert trainer["command"] == ["run"] and trainer["environment"]["FEEDLINE_TRAIN_CMD"] == "feedline train"


def test_compose_without_env_points_the_sampler_at_the_demo_store_which_the_demo_profile_runs():
    plain = resolved(env_file=None)["services"]
    source = plain["sampler"]["environment"]["FEEDLINE_SOURCE"]
    assert source == "http://demo-store:8080/index.txt"
    demo = resolved("--profile", "demo", env_file=None)["services"]
    store = demo["demo-store"]
    assert store["profiles"] == ["demo"]
    assert store["command"][:2] == ["serve", "/tmp/demo"] and "--demo-samples" in store["command"]
    port = store["command"][store["command"].index("--port") + 1]
    assert source.startswith(f"http://demo-store:{port}/") and {"prometheus", "grafana", "trainer"} <= set(demo)


def test_the_compose_trainer_is_retried_on_failure_and_left_finished():
    services = compose()["services"]
    assert services["trainer"]["restart"] == "on-failure"
    assert services["sampler"]["restart"] == "unless-stopped"  # the sidecar serves as long as the node runs


def test_the_compose_trainer_runs_the_users_command_from_the_mounted_workspace():
    trainer = resolved()["services"]["trainer"]
    mounts = {target: (source, mode) for source, target, mode in (v.split(":") for v in trainer["volumes"])}
    assert mounts["/workspace"][0].endswith("/examples") and mounts["/workspace"][1] == "ro"
    assert mounts["/checkpoints"][0] == "checkpoints"  # a named volume: checkpoints outlive the container
    assert trainer["working_dir"] == "/workspace"


def test_the_sampler_donates_a_sized_shm_that_the_trainer_joins():
    services = compose()["services"]
    sampler, trainer = services["sampler"], services["trainer"]
    assert sampler["ipc"] == "shareable" and sampler["shm_size"].startswith("${FEEDLINE_SHM_SIZE")
    assert trainer["ipc"] == "service:sampler"
    # podman-compose ignores `ipc:`: its pod shares the IPC namespace, sized as Docker sizes the sampler's
    pod = compose()["x-podman"]
    assert pod["in_pod"] is True and "--share=ipc" in pod["pod_args"]
    assert "--shm-size=${FEEDLINE_SHM_SIZE:-10g}" in pod["pod_args"] and sampler["shm_size"] == "${FEEDLINE_SHM_SIZE:-10g}"
    assert trainer["depends_on"]["sampler"]["condition"] == "service_healthy"
    device = trainer["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert services["dcgm-exporter"]["profiles"] == ["dcgm"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in services["grafana"]["volumes"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]


def test_the_cpu_override_drops_the_gpu_reservation_and_trains_on_the_cpu():
    class Loader(yaml.SafeLoader):  # `!reset` is Compose's (>= 2.24) and podman-compose's tag
        pass

    Loader.add_constructor("!reset", lambda loader, node: {"!reset": loader.construct_mapping(node)})
    with open(os.path.join(ROOT, "compose.cpu.yaml")) as f:
        trainer = yaml.load(f, Loader=Loader)["services"]["trainer"]
    assert trainer["deploy"] == {"!reset": {}} and trainer["environment"] == {"FEEDLINE_DEVICE": "cpu"}
    assert "deploy" in compose()["services"]["trainer"]  # what it resets


def test_env_example_sets_every_knob_compose_reads():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        used = set(re.findall(r"\$\{((?:FEEDLINE|AWS)_[A-Z_]+|[A-Z]+_PROXY)", f.read()))
    with open(os.path.join(ROOT, ".env.example")) as f:
        given = set(re.findall(r"^((?:FEEDLINE|AWS)_[A-Z_]+|[A-Z]+_PROXY)=", f.read(), re.M))
    assert used <= given, used - given


# -- compose: the security defaults (docs/deployment.md, "Security defaults") -----------------------------

def test_kubernetes_validate_strict_accepts_every_manifest():
    files = sorted(os.path.join(K8S, f) for f in os.listdir(K8S) if f.endswith(".yaml")) + [SECRET_EXAMPLE]
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", *files], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed for resource job/feedline" in out.stdout + out.stderr


def single_node():
    return load_all(os.path.join(K8S, "job.yaml"))[0]


def test_the_pod_runs_the_sampler_as_a_native_sidecar_over_a_memory_emptydir():
    pod = single_node()["spec"]["template"]["spec"]
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
    pod = single_node()["spec"]["template"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"] for p in c["ports"]}
    assert mon["kind"] == "PodMonitor"
    assert {e["port"] for e in mon["spec"]["podMetricsEndpoints"]} <= ports


def test_the_single_node_job_restarts_a_failed_trainer_in_its_pod_and_leaves_a_finished_one():
    job = single_node()
    spec = job["spec"]["template"]["spec"]
    assert job["kind"] == "Job" and spec["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] >= 1
    trainer = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["FEEDLINE_RESUME"] == "true"  # a restart goes on from the checkpoint in the pod's volume
    assert {"mountPath": env["FEEDLINE_CHECKPOINT"], "name": "checkpoints"} in trainer["volumeMounts"]


def test_both_manifests_start_the_training_through_feedline_run():
    trainer = single_node()["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["tini", "--", "feedline", "run", "--"] and trainer["args"] == ["feedline", "train"]
    _, job, _ = multinode()
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["tini", "--", "feedline", "run", "--", "torchrun"]


def multinode():
    docs = {d["kind"]: d for d in load_all(os.path.join(K8S, "multinode.yaml"))}
    return docs["Service"], docs["Job"], docs["PersistentVolumeClaim"]


def test_the_multinode_job_partitions_the_source_per_node():
    service, job, _ = multinode()
    assert service["spec"]["clusterIP"] == "None"
    assert job["spec"]["completionMode"] == "Indexed"
    spec = job["spec"]["template"]["spec"]
    assert spec["subdomain"] == service["metadata"]["name"]
    env = {e["name"]: e for e in spec["initContainers"][0]["env"]}
    assert "job-completion-index" in env["FEEDLINE_PARTITION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert int(env["FEEDLINE_PARTITION_COUNT"]["value"]) == job["spec"]["completions"]
    trainer_env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert trainer_env["FEEDLINE_RANK_SCOPE"] == "local"


def torchrun_flags(container):
    return dict(a[2:].split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)


def test_the_multinode_job_is_one_torchrun_job_whose_node_rank_is_the_completion_index():
    service, job, _ = multinode()
    spec = job["spec"]["template"]["spec"]
    trainer = spec["containers"][0]
    assert trainer["command"][-1] == "torchrun" and trainer["args"][-3:] == ["-m", "feedline", "train"]
    flags = torchrun_flags(trainer)
    assert int(flags["nnodes"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    env = {e["name"]: e for e in trainer["env"]}
    var = re.fullmatch(r"\$\((\w+)\)", flags["node-rank"]).group(1)
    assert "job-completion-index" in env[var]["valueFrom"]["fieldRef"]["fieldPath"]
    # rank 0's pod: <job>-0 under the headless Service, on the port the Service names
    assert flags["master-addr"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(flags["master-port"]) == service["spec"]["ports"][0]["port"]
    assert service["spec"]["selector"]["job-name"] == job["metadata"]["name"]
    assert env["FEEDLINE_EQUAL_BATCHES"]["value"] in ("drop", "pad")


def test_the_multinode_job_checkpoints_to_a_shared_volume_and_resumes_after_a_restart():
    _, job, claim = multinode()
    spec = job["spec"]["template"]["spec"]
    trainer = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["FEEDLINE_RESUME"] == "true"
    mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert env["FEEDLINE_CHECKPOINT"].startswith(mounts["checkpoints"] + "/")
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    assert job["spec"]["backoffLimit"] > 0  # a preempted pod's job is started again, and resumes
    assert spec["terminationGracePeriodSeconds"] >= 60


def test_the_s3_variant_takes_credentials_from_a_secret_and_the_endpoint_from_env():
    _, job, _ = multinode()
    sampler = job["spec"]["template"]["spec"]["initContainers"][0]
    env = {e["name"]: e.get("value") for e in sampler["env"]}
    assert env["FEEDLINE_SOURCE"].startswith("s3://") and env["AWS_ENDPOINT_URL"].startswith("https://")
    (secret,) = load_all(SECRET_EXAMPLE)
    assert sampler["envFrom"][0]["secretRef"]["name"] == secret["metadata"]["name"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secret["stringData"])
    with open(os.path.join(ROOT, ".env.example")) as f:
        given = set(re.findall(r"^(AWS_[A-Z_]+)=", f.read(), re.M))
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} <= given
    assert {"AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL"} <= set(compose()["services"]["sampler"]["environment"])


def test_a_local_rank_scope_splits_by_local_rank(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Rank.detect() == Rank(5, 8)
    assert Rank.detect(local=True) == Rank(1, 4)


# -- Kubernetes: the security defaults ----------------------------------------------------------------------

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

def test_doctor_names_shm_size_and_sizelimit_when_the_budget_does_not_fit(small_tmpfs):
    out = subprocess.run([sys.executable, "-m", "feedline", "doctor", "--cache", str(small_tmpfs / "feedline"),
                          "--budget", "256MiB"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 1
    assert "FAIL" in text and "64.0 MiB in all" in text
    assert "shm_size" in text and "sizeLimit" in text


def test_doctor_passes_a_budget_that_fits(small_tmpfs):
    out = subprocess.run([sys.executable, "-m", "feedline", "doctor", "--cache", str(small_tmpfs / "feedline"),
                          "--budget", "16MiB", "--fetch-threads", "1", "--batch-size", "8"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert "FAIL" not in out.stdout + out.stderr
    assert out.returncode == 0
    row = next(line for line in out.stderr.splitlines() if "JPEG crop decoder" in line)  # issue 35: built here
    assert " ok " in row and "libjpeg-turbo" in row, row


def test_the_sampler_refuses_to_start_into_a_bus_error(small_tmpfs, tmp_path):
    from helpers import id_shards

    id_shards(str(tmp_path / "remote"), shards=2, per_shard=5)
    out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source", str(tmp_path / "remote"),
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
    assert "SKIPPED" in text
    # compose.yaml itself, by podman-compose, with the CPU override; not hand-written `podman run` lines
    assert "podman-compose" in text and "-f compose.yaml -f compose.cpu.yaml --profile demo" in text
    assert "down -v" in text and "podman run -d" not in text
    assert shutil.which("bash")
