"""The deployment's security defaults (issue 49, item 6): compose publishes on 127.0.0.1, Grafana has no anonymous
admin, containers drop capabilities on a read-only root, the Kubernetes pods are locked down behind a NetworkPolicy,
and `kubectl apply -f deploy/k8s/` applies no Secret."""

import os
import subprocess

import yaml

from test_deploy import K8S, ROOT, SECRET_EXAMPLE, load_all, multinode, resolved, single_node

def host_addresses(services):
    """service -> the host addresses its ports are published on, as docker-compose resolves them."""
    def address(port):
        if isinstance(port, dict):
            return port.get("host_ip", "0.0.0.0")  # no address: every interface
        return port.rsplit(":", 2)[0] if port.count(":") == 2 else "0.0.0.0"
    return {name: {address(p) for p in svc["ports"]} for name, svc in services.items() if svc.get("ports")}


def test_compose_publishes_every_port_on_localhost_by_default():
    for env_file in (".env.example", None):
        addresses = host_addresses(resolved(env_file=env_file)["services"])
        assert {"sampler", "trainer", "prometheus", "grafana", "dcgm-exporter"} <= set(addresses)
        assert all(a == {"127.0.0.1"} for a in addresses.values()), (env_file, addresses)


def test_feedline_bind_publishes_every_port_on_the_address_it_names():
    addresses = host_addresses(resolved(env_file=None, env={"FEEDLINE_BIND": "192.0.2.7"})["services"])
    assert addresses and all(a == {"192.0.2.7"} for a in addresses.values()), addresses


def test_grafana_has_no_anonymous_access_and_takes_the_admin_password_from_the_environment():
    grafana = resolved(env={"FEEDLINE_GRAFANA_PASSWORD": "s3cret-from-env"})["services"]["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "s3cret-from-env" and env["GF_USERS_ALLOW_SIGN_UP"] == "false"


def grafana_start(password):
    """Grafana's entrypoint, run by a real sh with the environment compose gives the container."""
    grafana = resolved(env={"FEEDLINE_GRAFANA_PASSWORD": password})["services"]["grafana"]
    command = [a.replace("$$", "$") for a in grafana["entrypoint"]]  # compose's escape, as it runs
    return subprocess.run(command, env={"PATH": os.environ["PATH"], **grafana["environment"]},
                          capture_output=True, text=True, timeout=30)


def test_grafana_without_a_password_refuses_to_start_naming_the_variable_to_set():
    refused = grafana_start("")  # .env.example's empty value, or none at all
    assert refused.returncode != 0 and "set FEEDLINE_GRAFANA_PASSWORD" in refused.stderr, refused.stderr
    started = grafana_start("s3cret")  # goes on to the image's own /run.sh (not on this machine)
    assert "FEEDLINE_GRAFANA_PASSWORD" not in started.stderr and "/run.sh" in started.stderr, started.stderr


def test_every_container_but_dcgm_drops_all_capabilities_and_cannot_gain_privileges():
    services = resolved("--profile", "demo")["services"]
    for name in ("sampler", "trainer", "demo-store", "prometheus", "grafana"):
        svc = services[name]
        assert svc["cap_drop"] == ["ALL"] and not svc.get("cap_add"), name
        assert "no-new-privileges:true" in svc["security_opt"], name
    assert "no-new-privileges:true" in services["dcgm-exporter"]["security_opt"]  # DCGM needs SYS_ADMIN


def test_the_feedline_containers_and_prometheus_run_on_a_read_only_root():
    services = resolved("--profile", "demo")["services"]
    for name in ("sampler", "trainer", "demo-store", "prometheus"):
        assert services[name]["read_only"] is True, name
    for name in ("sampler", "trainer", "demo-store"):  # torchrun's files, the demo store's dataset
        assert "/tmp" in services[name]["tmpfs"], name
    prometheus = services["prometheus"]  # its data on its volume, named (Debian's build puts it elsewhere)
    data = next(a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--storage.tsdb.path="))
    assert any(data.startswith(v.split(":")[1] + "/") for v in prometheus["volumes"]), data



def test_grafana_runs_on_a_read_only_root_writing_only_to_tmpfs():
    """What Grafana's image writes (GF_PATHS_DATA=/var/lib/grafana: its database and the plugins/ its run.sh makes;
    Go's temporary files; GF_PATHS_LOGS should file logging be on) lands on a tmpfs; every file mounted is read-only."""
    grafana = resolved()["services"]["grafana"]
    assert grafana["read_only"] is True
    assert {"/tmp", "/var/lib/grafana", "/var/log/grafana"} <= set(grafana["tmpfs"])
    assert all(v.endswith(":ro") for v in grafana["volumes"]), grafana["volumes"]


def test_grafanas_dashboards_are_provisioned_from_the_folder_compose_mounts():
    grafana = resolved()["services"]["grafana"]
    mounted = {v.split(":")[1] for v in grafana["volumes"]}
    with open(os.path.join(ROOT, "grafana", "provisioning", "dashboards", "feedline.yml")) as f:
        path = yaml.safe_load(f)["providers"][0]["options"]["path"]
    assert path in mounted and not path.startswith("/var/lib/grafana")  # not under the data tmpfs
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == path + "/feedline.json"
    assert os.path.exists(os.path.join(ROOT, "grafana", "dashboards", "feedline.json"))

# -- Kubernetes -------------------------------------------------------------------------------------------


def pod_specs():
    ray = {f"ray-decode.yaml: {d['metadata']['name']}": d["spec"]["template"]["spec"]
           for d in load_all(os.path.join(K8S, "ray-decode.yaml")) if d["kind"] == "Deployment"}
    return {"job.yaml": single_node()["spec"]["template"]["spec"],
            "multinode.yaml": multinode()[1]["spec"]["template"]["spec"], **ray}


def test_every_kubernetes_container_is_locked_down_with_a_writable_tmp():
    for where, pod in pod_specs().items():
        empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
            tmp = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert len(tmp) == 1 and tmp[0] in empty_dirs, (where, c["name"])  # torchrun's files


def test_the_kubernetes_pods_get_no_service_account_token():
    for where, pod in pod_specs().items():
        assert pod["automountServiceAccountToken"] is False, where


def allows(policy, labels, namespace, port):
    """Whether the NetworkPolicy lets a pod (labels, namespace) reach the selected pods' port (same namespace
    "feedline"); NetworkPolicy's rules: a peer's podSelector alone means this namespace, with a
    namespaceSelector that namespace's pods; no `ports` means every port."""
    def matches(selector, have):
        return selector.get("matchLabels", {}).items() <= have.items() and not selector.get("matchExpressions")

    def peer(p):
        if "ipBlock" in p:
            return True
        ns = p.get("namespaceSelector")
        in_ns = matches(ns, {"kubernetes.io/metadata.name": namespace}) if ns is not None else namespace == "feedline"
        return in_ns and matches(p.get("podSelector", {}), labels)

    return any(any(peer(p) for p in rule.get("from", [{"ipBlock": {}}]))
               and (not rule.get("ports") or any(p["port"] == port for p in rule["ports"]))
               for rule in policy["spec"]["ingress"])


def test_a_networkpolicy_lets_only_the_jobs_peers_and_prometheus_reach_the_pods():
    (policy,) = load_all(os.path.join(K8S, "networkpolicy.yaml"))
    assert policy["kind"] == "NetworkPolicy" and "Ingress" in policy["spec"]["policyTypes"]
    pods = [single_node()["spec"]["template"], multinode()[1]["spec"]["template"]]
    assert all(policy["spec"]["podSelector"]["matchLabels"].items() <= p["metadata"]["labels"].items() for p in pods)
    ports = {p["name"]: p["containerPort"] for t in pods for c in t["spec"]["initContainers"] + t["spec"]["containers"]
             for p in c["ports"]}
    metrics, rendezvous = {ports["sampler-metrics"], ports["trainer-metrics"]}, ports["rendezvous"]
    assert rendezvous == multinode()[0]["spec"]["ports"][0]["port"]
    peer = pods[1]["metadata"]["labels"]
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert all(allows(policy, peer, "feedline", p) for p in metrics | {rendezvous, 45123})  # NCCL picks ports
    assert all(allows(policy, prometheus, "monitoring", p) for p in metrics)
    assert not allows(policy, prometheus, "monitoring", rendezvous)
    for stranger, namespace in (({"app": "web"}, "feedline"), (peer, "elsewhere"), (prometheus, "feedline")):
        assert not any(allows(policy, stranger, namespace, p) for p in metrics | {rendezvous}), (stranger, namespace)


def test_kubectl_apply_of_the_k8s_folder_applies_no_secret_with_data():
    read = [f for f in os.listdir(K8S) if f.endswith((".yaml", ".yml", ".json"))]  # what `apply -f DIR` reads
    docs = [d for f in read for d in load_all(os.path.join(K8S, f))]
    assert not [d for d in docs if d["kind"] == "Secret" and (d.get("data") or d.get("stringData"))]
    (example,) = load_all(SECRET_EXAMPLE)  # the placeholder, applied only by name
    assert example["kind"] == "Secret" and set(example["stringData"].values()) == {"replace-me"}


# -- the Dockerfile ---------------------------------------------------------------------------------------


def test_a_shell_that_exported_the_compose_variables_still_runs_feedline():
    import re

    from feedline.api.config import Config

    text = "".join(open(os.path.join(ROOT, f)).read() for f in ("compose.yaml", "compose.cpu.yaml", ".env.example"))
    env = {name: "1" for name in set(re.findall(r"FEEDLINE_[A-Z_]+", text))} | {"FEEDLINE_BIND": "127.0.0.1"}
    names = {Config.env_name(n) for n in Config.names()}
    Config.load({}, env={k: v for k, v in env.items() if k not in names})  # compose's own knobs: no unknown setting
