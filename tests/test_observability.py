"""Metrics, rules and the dashboard, proven against promtool and a real Prometheus."""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from html import escape as html_escape
from html import unescape as html_unescape
from html.parser import HTMLParser

import numpy as np
import pytest
import yaml
from helpers import KEPT_FOR_THE_MODULE, ROOT, Sampler, id_shards, jpeg_bytes, wait_for, write_tar
from prometheus_client import generate_latest

from feedline import StagingLoader
from feedline.demo.procs import free_port
from feedline.demo.prometheus import PrometheusServer
from feedline.demo.store import FileStore
from feedline.metrics import dashboard, grafana
from feedline.metrics.catalog import LOADER, SAMPLER
from feedline.metrics.exporter import MetricsPortError
from feedline.metrics.sink import PrometheusSink
from feedline.report.prometheus import PrometheusAPI

# in one xdist worker: one Prometheus-scraped run (fed_run) and one report for the module
pytestmark = pytest.mark.xdist_group("observability")

PROM = os.path.join(ROOT, "deploy", "prometheus")
ALLOWED_LABELS = {"queue", "state", "stage", "reason", "kind", "version", "rank", "le", "thread", "side", "place",
                  "direction"}


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


@contextlib.contextmanager
def _stack(tmp):
    """A store, a sampler that keeps fetching, a Prometheus; the trainer is started by the caller."""
    data = tmp / "remote"
    data.mkdir()
    for k in range(6):
        write_tar(str(data / f"ids-{k:04d}.tar"),
                  [(f"{k}{i:04d}", {"jpg": jpeg_bytes(i), "cls": str(i).encode()}) for i in range(24)])
    cache = str(tmp / "cache")
    script = tmp / "trainer.py"
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

        def stop():
            for p in procs:
                p.terminate()
                p.communicate(timeout=30)
            procs.clear()

        try:
            yield prom, start_trainer, stop
        finally:
            stop()


def _settle(prom, seconds=8.0):
    """Wait for both targets' scrapes and enough points for 15 s rates."""
    prom.wait_for('feedline_build_info{component="trainer"}', timeout=40)
    prom.wait_for('feedline_build_info{component="sampler"}', timeout=40)
    time.sleep(seconds)


@dataclasses.dataclass
class Run:
    """A fed run (a 50 ms step, decoding keeps up) that Prometheus scraped from before its start until ``end``."""

    prom: PrometheusServer
    start: float
    end: float
    tmp: object

    def interval(self):
        # Grafana's data source for this Prometheus would say its scrape interval (1 s here; the shipped
        # provisioning says 15 s, the shipped Prometheus's): the minimum step, and $__rate_interval from it.
        return grafana.Interval(self.start, self.end, scrape_interval=1.0)

    def range(self, expr):
        api = PrometheusAPI(self.prom.url)
        return [s for s in api.query_range(expr, self.start, self.end, self.interval().step) if s.values]


@pytest.fixture(scope="module")
def fed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fed")
    with _stack(tmp) as (prom, start_trainer, stop):
        start = time.time() - 5  # the sampler's first scrapes are in the range too
        start_trainer(step=0.05, decode=0)
        _settle(prom)
        end = time.time()
        stop()  # Prometheus keeps what it scraped; the other tests get the CPUs
        KEPT_FOR_THE_MODULE.add(prom.proc.pid)
        try:
            yield Run(prom, start, end, tmp)
        finally:
            KEPT_FOR_THE_MODULE.discard(prom.proc.pid)
    assert prom.proc.poll() is not None, "the run's Prometheus outlived its fixture"


@pytest.fixture
def stack(tmp_path):
    with _stack(tmp_path) as (prom, start_trainer, _):
        yield prom, start_trainer


# Queries that cannot return data on this machine, and why (the panel's other queries must).
NEEDS_WHAT_THIS_MACHINE_LACKS = {
    "copy p90": "CUDA: a host-to-device copy is timed only when batches go to a GPU",
    "engine active": "DCGM: dcgm-exporter needs an NVIDIA GPU",
    "GPU util": "DCGM: dcgm-exporter needs an NVIDIA GPU",
}


def panel_queries():
    return [(p.title, q) for _, row in dashboard.ROWS for p in row for q in p.queries]


@pytest.mark.parametrize("title, query", panel_queries(), ids=[f"{t}: {q.legend}" for t, q in panel_queries()])
def test_every_panel_query_returns_data_over_the_run_as_grafana_sends_it(fed_run, title, query):
    if query.legend in NEEDS_WHAT_THIS_MACHINE_LACKS:
        pytest.skip(NEEDS_WHAT_THIS_MACHINE_LACKS[query.legend])
    expr = grafana.substitute(query.expr, fed_run.interval())
    assert fed_run.range(expr), f"{title}: no series with data for {expr}"


def test_every_panel_draws_data_without_what_this_machine_lacks():
    for _, row in dashboard.ROWS:
        for p in row:
            assert any(q.legend not in NEEDS_WHAT_THIS_MACHINE_LACKS for q in p.queries) or all(
                q.optional for q in p.queries), f"{p.title} would be tested by nothing"


def test_grafanas_substitution_of_variables_and_intervals():
    interval = grafana.Interval(0, 3600, scrape_interval=15)  # an hour over 1000 points: a 15 s step
    assert interval.step == 15 and interval.rate_interval == 60
    wide = grafana.Interval(0, 86400, scrape_interval=15)  # a day: 86.4 s a point
    assert wide.step == 86.4 and wide.rate_interval == 101.4
    expr = dashboard._rate("feedline_samples_total")
    assert grafana.substitute(expr, interval) == (
        'sum (rate(feedline_samples_total{job=~".*", instance=~".*"}[60s]))')
    chosen = grafana.Variables(job=["feedline"], instance=["a:1", "b.c:2"])
    assert grafana.substitute(expr, wide, chosen) == (
        'sum (rate(feedline_samples_total{job=~"feedline", instance=~"(a:1|b\\.c:2)"}[102s]))')
    assert grafana.legend("{{stage}} {{nope}}", {"stage": "read"}) == "read "


def test_every_recording_rule_returns_data_over_the_run(fed_run):
    for rule in recording_rules():
        if "record" in rule:
            assert fed_run.range(rule["record"]), f"no data for recording rule {rule['record']}"


def test_every_alert_evaluates_over_the_run_and_every_series_it_reads_exists(fed_run):
    for rule in recording_rules():
        if "alert" not in rule:
            continue
        fed_run.range(rule["expr"])  # Prometheus accepts it over a range (a refused query raises)
        for name in set(re.findall(r"(?<![\w:])((?:job:)?feedline_[a-z0-9_:]+)", rule["expr"])):
            assert fed_run.range(name), f"{rule['alert']} reads {name}, which the run does not have"


def test_a_fed_run_is_not_starved(fed_run):
    series = fed_run.range(grafana.substitute(dashboard.STARVATION, fed_run.interval()))
    assert series and series[0].values[-1] < 0.2, series


def test_an_instant_step_with_slow_decoding_is_starved(stack):
    prom, start_trainer = stack
    start_trainer(step=0, decode=0.01)
    _settle(prom)
    ratio = prom.value(substitute(dashboard.STARVATION))
    recorded = prom.wait_for("job:feedline_gpu_starvation:ratio_rate1m", timeout=20)
    assert ratio is not None and ratio > 0.8
    assert float(recorded[0]["value"][1]) > 0.8
    assert json.dumps(recorded)


# -- the report: the same panel queries, as a page, opened in a real browser ---------------------------------

def _timeseries_panels_with_data_here():
    return [p.title for _, row in dashboard.ROWS for p in row
            if p.kind == "timeseries" and any(q.legend not in NEEDS_WHAT_THIS_MACHINE_LACKS for q in p.queries)]


@pytest.fixture(scope="module")
def report(fed_run):
    path = fed_run.tmp / "report.html"
    out = subprocess.run([sys.executable, "-m", "feedline", "report", "--prometheus", fed_run.prom.url,
                          "--since", str(fed_run.start), "--until", str(fed_run.end), "--out", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"report: {path} (" in out.stdout + out.stderr
    return path


def test_the_report_plots_every_panel_that_has_data_on_this_machine(report):
    page = report.read_text()
    assert page.count('class="plotly-graph-div"') == len(_timeseries_panels_with_data_here())
    for title in _timeseries_panels_with_data_here():
        assert html_escape(title) in page


class _References(HTMLParser):
    """Every URL the page's markup loads or links (the text inside <script> is code, not markup)."""

    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        self.urls += [value for name, value in attrs if name in ("src", "href", "data", "srcset") and value]


def test_the_report_needs_no_network_to_view(report):
    page = report.read_text()
    refs = _References()
    refs.feed(page)
    assert [u for u in refs.urls if not u.startswith(("#", "data:"))] == []
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js is in the page itself


def test_the_report_refuses_a_prometheus_that_does_not_answer(tmp_path):
    out = subprocess.run([sys.executable, "-m", "feedline", "report", "--prometheus", f"http://127.0.0.1:{free_port()}",
                          "--out", str(tmp_path / "r.html")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "did not answer" in out.stderr and "--prometheus" in out.stderr
    assert not (tmp_path / "r.html").exists()


def chromium(*args, timeout=120):
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "chromium is not installed (Debian package 'chromium'; ./scripts/setup installs it)"
    profile = tempfile.mkdtemp(prefix="feedline-chromium-")
    try:
        return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               f"--user-data-dir={profile}", "--virtual-time-budget=15000",
                               "--host-resolver-rules=MAP * ~NOTFOUND", *args],  # no network, as offline
                              capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def test_the_report_draws_every_plot_with_data_in_headless_chromium_and_logs_no_error(report, tmp_path):
    dom = chromium("--dump-dom", report.as_uri())
    body = re.search(r"<body([^>]*)>", dom.stdout)
    assert body, dom.stderr[-2000:]
    attrs = dict(re.findall(r'(data-[a-z]+)="([^"]*)"', body.group(1)))
    drawn = json.loads(html_unescape(attrs["data-plots"]))
    errors = json.loads(html_unescape(attrs["data-errors"]))
    assert errors == []
    assert len(drawn) == len(_timeseries_panels_with_data_here()) and all(n >= 1 for n in drawn.values()), drawn
    shot = tmp_path / "report.png"
    chromium(f"--screenshot={shot}", "--window-size=1280,2400", "--hide-scrollbars", report.as_uri())
    from PIL import Image

    image = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert image.shape == (2400, 1280)
    assert (image < 200).mean() > 0.02  # plots and text drawn, not a blank page
