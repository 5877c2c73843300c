"""Metrics, rules and the dashboard, proven against promtool and a real Prometheus."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import yaml
from helpers import ROOT, Sampler, id_shards, jpeg_bytes, wait_for, write_tar
from prometheus_client import generate_latest

from feedline import StagingLoader
from feedline.demo.procs import free_port
from feedline.demo.prometheus import PrometheusServer
from feedline.demo.store import FileStore
from feedline.metrics import dashboard
from feedline.metrics.catalog import LOADER, SAMPLER
from feedline.metrics.exporter import MetricsPortError
from feedline.metrics.sink import PrometheusSink

PROM = os.path.join(ROOT, "deploy", "prometheus")
ALLOWED_LABELS = {"queue", "state", "stage", "reason", "kind", "version", "rank", "le"}


def promtool(*args, stdin=None):
    return subprocess.run(["promtool", *args], input=stdin, capture_output=True, text=True, cwd=PROM)


def exported_text():
    """The exposition of both processes' metrics, from their real sinks, before anything was pushed."""
    return (generate_latest(PrometheusSink(LOADER).registry).decode(),
            generate_latest(PrometheusSink(SAMPLER).registry).decode())


def family_names(text):
    return {m.group(1) for m in re.finditer(r"^# TYPE (\S+) \S+$", text, re.M)}


def sample_names(text):
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def recording_rules():
    with open(os.path.join(PROM, "rules", "feedline.yml")) as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"]]


def substitute(expr, rate="15s"):
    return expr.replace("$__rate_interval", rate).replace('"$job"', '"feedline"').replace('"$instance"', '".*"')


# -- promtool ----------------------------------------------------------------------------------------

def test_promtool_accepts_the_prometheus_config():
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_shipped_prometheus_has_no_dcgm_target_while_dcgm_exporter_is_not_running():
    # the compose file's Prometheus config as shipped; no host here is called dcgm-exporter (nor trainer/sampler)
    with PrometheusServer({}, config_path=os.path.join(PROM, "prometheus.yml")) as prom:
        prom.wait_until_ready()
        assert "dcgm" in prom.api("status/config")["yaml"]

        def own(metric):  # Prometheus's own /metrics: how many DNS lookups its discovery made
            with urllib.request.urlopen(f"{prom.url}/metrics", timeout=5) as r:
                return sum(float(line.split()[-1]) for line in r.read().decode().splitlines()
                           if line.startswith(metric))

        def targets():
            return prom.api("targets")["activeTargets"]

        # discovery has looked dcgm-exporter up, and the static targets have reached the scrape manager
        assert wait_for(lambda: own("prometheus_sd_dns_lookups_total") >= 1 and len(targets()) >= 2, timeout=40)
        assert {t["labels"]["job"] for t in targets()} == {"feedline"}
        assert prom.query('up{job="dcgm"}') == []


def test_promtool_accepts_the_rules():
    out = promtool("check", "rules", "rules/feedline.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    names = [r.get("record") for r in recording_rules() if "record" in r]
    assert all(re.fullmatch(r"[a-z_]+:feedline_[a-z_0-9]+:[a-z_0-9]+", n) for n in names)  # level:metric:operation


def test_the_rules_pass_their_unit_tests():
    out = promtool("test", "rules", "tests/feedline_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_waits_with_a_for_clause():
    alerts = {r["alert"]: r for r in recording_rules() if "alert" in r}
    assert set(alerts) == {"FeedlineInputStarved", "FeedlineCacheNotGrowing", "FeedlineFetchErrors",
                           "FeedlineSampleErrors", "FeedlineWorkerRestarts", "FeedlineShmAlmostFull"}
    assert all("for" in r and r["annotations"]["summary"] for r in alerts.values())
    assert alerts["FeedlineInputStarved"]["for"] == "10m" and "> 0.2" in alerts["FeedlineInputStarved"]["expr"]


def test_both_exporters_pass_promtool_check_metrics():
    for text in exported_text():
        out = promtool("check", "metrics", stdin=text)
        assert out.returncode == 0, out.stdout + out.stderr


# -- the exporters ---------------------------------------------------------------------------------------

def test_every_series_exists_at_zero_before_any_batch():
    loader_text, sampler_text = exported_text()
    for reason in ("corrupt", "too_large", "missing_field"):
        assert f'feedline_sample_errors_total{{reason="{reason}"}} 0.0' in loader_text
    for queue in ("free", "decoded", "device"):
        assert f'feedline_queue_depth{{queue="{queue}"}} 0.0' in loader_text
    assert 'feedline_fetch_errors_total{reason="timeout"} 0.0' in sampler_text
    assert "feedline_cache_evictions_total 0.0" in sampler_text


def test_labels_are_of_low_cardinality_only():
    for text in exported_text():
        for labels in re.findall(r"\{([^}]*)\}", text):
            names = {kv.split("=")[0] for kv in labels.split(",") if kv}
            assert names <= ALLOWED_LABELS, names


def test_a_rank_label_appears_only_where_torchrun_gives_a_rank():
    text = generate_latest(PrometheusSink(LOADER, {"rank": "3"}).registry).decode()
    assert 'feedline_samples_total{rank="3"}' in text
    assert 'rank="' not in exported_text()[0]


def test_a_metric_name_outside_the_catalog_is_a_bug_not_a_new_series():
    sink = PrometheusSink(LOADER)
    with pytest.raises(KeyError):
        sink.inc("samples_totl")


def test_the_loader_pushes_its_stats_to_the_sink_it_is_given(tmp_path):
    shards = id_shards(str(tmp_path / "ids"), shards=2, per_shard=20)
    sink = PrometheusSink(LOADER)
    from feedline.loader.loader import StagingLoader as LibraryLoader

    with LibraryLoader(shards, batch_size=8, workers=2, sink=sink) as loader:
        for _ in loader:
            pass
        stats = loader.stats()
    assert sink.value("samples_total") == stats.samples_total == 40
    assert sink.value("bytes_total", stage="decoded") == stats.bytes_total["decoded"]
    assert sink.value("data_wait_seconds_total") == pytest.approx(stats.data_wait_seconds_total)
    assert sink.value("loader_epoch") == 0


def test_the_trainer_serves_metrics_health_and_readiness(tmp_path):
    shards = id_shards(str(tmp_path / "ids"), shards=2, per_shard=20)
    with StagingLoader(shards, batch_size=8, workers=2, metrics_port=0) as loader:
        for _ in loader:
            pass
        port = loader.metrics.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            text = r.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz") as r:
            assert r.status == 200
    assert "feedline_samples_total 40.0" in text
    assert promtool("check", "metrics", stdin=text).returncode == 0


def test_a_metrics_port_in_use_is_refused_naming_the_port_and_setting(tmp_path):
    shards = id_shards(str(tmp_path / "ids"), shards=2, per_shard=5)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsPortError, match=f"{port}.*metrics_port"):
            StagingLoader(shards, batch_size=4, workers=1, metrics_port=port)


# -- the dashboard ----------------------------------------------------------------------------------------

def test_the_committed_dashboard_is_what_the_code_generates():
    with open(os.path.join(ROOT, "grafana", "dashboards", "feedline.json")) as f:
        assert f.read() == dashboard.render(), "run `feedline dashboard` and commit the result"


def test_every_panel_has_a_unit_a_description_and_rates_over_rate_interval():
    doc = dashboard.build()
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    for p in panels:
        assert p["description"] and p["fieldConfig"]["defaults"]["unit"], p["title"]
        for t in p["targets"]:
            for window in re.findall(r"\[([^\]]+)\]", t["expr"]):
                assert window == "$__rate_interval", (p["title"], t["expr"])
    assert doc["uid"] == "feedline"
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "job", "instance"]


def test_the_dashboard_uses_the_provisioned_datasource():
    with open(os.path.join(ROOT, "grafana", "provisioning", "datasources", "prometheus.yml")) as f:
        ds = yaml.safe_load(f)["datasources"][0]
    assert ds["uid"] == dashboard.DATASOURCE_UID and ds["type"] == "prometheus"
    with open(os.path.join(ROOT, "grafana", "provisioning", "dashboards", "feedline.yml")) as f:
        provider = yaml.safe_load(f)["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_the_dashboard_shows_only_exported_metrics_and_every_exported_metric_somewhere():
    loader_text, sampler_text = exported_text()
    exported = sample_names(loader_text) | sample_names(sampler_text)
    families = family_names(loader_text) | family_names(sampler_text)
    shown = " ".join(dashboard.expressions(include_optional=False) + [r["expr"] for r in recording_rules()])
    used = set(re.findall(r"(?<![:\w])feedline_[a-z0-9_]+", shown))  # not recorded names (job:feedline_...)
    assert used <= exported, used - exported
    for family in families:
        assert any(name.startswith(family) for name in used), f"{family} is on no panel or rule"


# -- end to end: a real Prometheus scraping a sidecar and a training run ------------------------------------

TRAINER = textwrap.dedent("""
    import sys, time
    from feedline import StagingLoader

    class SlowDecode:
        def __init__(self, seconds):
            self.seconds = seconds
        def __call__(self, sample):
            time.sleep(self.seconds)
            return sample

    if __name__ == "__main__":
        cache, port, step, decode = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
        with StagingLoader(cache=cache, batch_size=8, workers=2, metrics_port=port, min_shards=2,
                           transform=SlowDecode(decode) if decode else None,
                           spec={"cls": "int64", "jpg": ("uint8", (72, 96, 3))}) as loader:
            while True:
                for batch in loader:
                    time.sleep(step)
""")


@pytest.fixture
def stack(tmp_path):
    """A store, a sampler that keeps fetching, a Prometheus; the trainer is started by the test."""
    data = tmp_path / "remote"
    data.mkdir()
    for k in range(6):
        write_tar(str(data / f"ids-{k:04d}.tar"),
                  [(f"{k}{i:04d}", {"jpg": jpeg_bytes(i), "cls": str(i).encode()}) for i in range(24)])
    cache = str(tmp_path / "cache")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    ports = {"sampler": free_port(), "trainer": free_port()}
    procs = []
    with FileStore(str(data)) as remote, PrometheusServer(ports) as prom:
        sampler = Sampler(remote, cache, "--policy", "fill", "--refresh-per-minute", "300", "--budget",
                          str(4 * os.path.getsize(data / "ids-0000.tar") + 100), "--min-shards", "2",
                          port=ports["sampler"])
        procs.append(sampler.proc)
        sampler.wait_ready()

        def start_trainer(step, decode):
            proc = subprocess.Popen([sys.executable, str(script), cache, str(ports["trainer"]), str(step), str(decode)],
                                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append(proc)
            return proc

        yield prom, start_trainer
        for p in procs:
            p.terminate()
            p.communicate(timeout=30)


def _settle(prom, seconds=8.0):
    """Wait for both targets' scrapes and enough points for 15 s rates."""
    prom.wait_for('feedline_build_info{component="trainer"}', timeout=40)
    prom.wait_for('feedline_build_info{component="sampler"}', timeout=40)
    time.sleep(seconds)


def test_every_panel_and_recording_rule_returns_data_and_a_slow_step_is_not_starved(stack):
    prom, start_trainer = stack
    start_trainer(step=0.05, decode=0)
    _settle(prom)
    for expr in dashboard.expressions(include_optional=False):
        assert prom.query(substitute(expr)), f"no data for panel expression: {expr}"
    for rule in recording_rules():
        if "record" in rule:
            assert prom.wait_for(rule["record"], timeout=20), f"no data for recording rule {rule['record']}"
    ratio = prom.value(substitute(dashboard.STARVATION))
    assert ratio is not None and ratio < 0.2


def test_an_instant_step_with_slow_decoding_is_starved(stack):
    prom, start_trainer = stack
    start_trainer(step=0, decode=0.01)
    _settle(prom)
    ratio = prom.value(substitute(dashboard.STARVATION))
    recorded = prom.wait_for("job:feedline_gpu_starvation:ratio_rate1m", timeout=20)
    assert ratio is not None and ratio > 0.8
    assert float(recorded[0]["value"][1]) > 0.8
    assert json.dumps(recorded)
