"""feedline's HTTP servers against clients that try to tie them up (issue 49): connections that send nothing or
trickle a byte at a time, more connections than the cap, and many distinct requests. Real servers on
127.0.0.1, real sockets; the timeouts are set short so that each test takes a few seconds at most."""

import gc
import http.client
import select
import socket
import threading
import time
import types
import urllib.request

import pytest
from helpers import wait_for
from prometheus_client import CollectorRegistry

from feedline.demo.store import Fault, FileStore
from feedline.metrics.exporter import MetricsServer


def metrics_server(**limits) -> MetricsServer:
    return MetricsServer(CollectorRegistry(), "127.0.0.1", 0, **limits)


def connect(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=5)


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (end of stream or reset), without waiting."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def read_to_end(sock: socket.socket) -> bytes:
    """What the server sends until it closes (a reset ends it too)."""
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionError:
        pass
    return answer


def seconds_until_closed(sock: socket.socket, limit: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if is_closed(sock):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def objects_reachable_from(root: object) -> int:
    """How many objects the server holds: everything reachable from it but numbers (counters change value, and
    two equal small ints are one object), not following into classes, modules, functions and frames (shared by
    the whole process, not the server's state)."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            types.CodeType, types.FrameType)
    seen = {id(root)}
    todo = [root]
    numbers = 0
    while todo:
        obj = todo.pop()
        # a dict with str keys shows the gc only its values: its keys are counted here
        for ref in [*obj.keys(), *obj.values()] if isinstance(obj, dict) else gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, skip):
                seen.add(id(ref))
                todo.append(ref)
                numbers += isinstance(ref, (int, float))
    return len(seen) - numbers


def test_an_idle_connection_is_closed_after_the_timeout():
    with metrics_server(timeout=0.5) as server:
        idle = connect(server)
        waited = seconds_until_closed(idle, 5)
        idle.close()
    assert waited is not None, "a connection that sent nothing was still open after 5 s"
    assert 0.4 <= waited < 2


def test_a_trickling_client_is_closed_after_the_timeout():
    # a byte every 0.1 s: a timeout per read (restarting at each byte) would never fire
    with metrics_server(timeout=1) as server:
        slow = connect(server)
        t0 = time.monotonic()
        head = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 1000
        closed_after = None
        for byte in head:
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - t0
                break
            if is_closed(slow):
                closed_after = time.monotonic() - t0
                break
            if time.monotonic() - t0 > 5:
                break
            time.sleep(0.1)
        slow.close()
    assert closed_after is not None, "a client sending a header byte every 0.1 s was still served after 5 s"
    assert 0.9 <= closed_after < 2.5


def test_connections_past_the_cap_start_no_threads():
    before = threading.active_count()
    with metrics_server(timeout=30, max_connections=4) as server:
        held = [connect(server) for _ in range(16)]
        # the server accepts in order: once a later connection is answered, all 16 have been handled
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as r:
            assert r.status == 200
        settled = wait_for(lambda: threading.active_count() - before <= 1 + 4, 2)  # the accept loop + the cap
        threads = threading.active_count() - before
        for sock in held:
            sock.close()
    assert settled, f"16 idle connections hold {threads - 1} threads, past the cap of 4"


def test_metrics_answer_while_the_caps_worth_of_slow_clients_hold_connections():
    # the timeout is long: only the cap's rule (an idle connection gives way to a new one) can let Prometheus in
    with metrics_server(timeout=30, max_connections=4) as server:
        slow = [connect(server) for _ in range(4)]
        for sock in slow:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: a")  # a head begun, never finished
        time.sleep(0.2)
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert r.status == 200
            r.read()
        answered_in = time.monotonic() - t0
        oldest_closed = seconds_until_closed(slow[0], 1) is not None
        for sock in slow:
            sock.close()
    assert answered_in < 1
    assert oldest_closed, "/metrics was answered beside 4 slow clients: the cap of 4 was not kept"


def test_a_connection_past_the_cap_while_every_slot_is_answering_is_turned_away_at_once(tmp_path):
    (tmp_path / "slow.tar").write_bytes(b"x" * 1024)
    (tmp_path / "b.tar").write_bytes(b"y" * 1024)
    with FileStore(str(tmp_path), timeout=5, max_connections=2) as store:
        store.faults["slow.tar"] = Fault(stall_before=1.5)
        busy = [threading.Thread(target=lambda: urllib.request.urlopen(f"{store.url}/slow.tar", timeout=10).read())
                for _ in range(2)]
        for t in busy:
            t.start()
        assert wait_for(lambda: store.requests.get("slow.tar") == 2, 5)
        before = threading.active_count()
        late = connect(store)
        t0 = time.monotonic()
        late.sendall(b"GET /b.tar HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = read_to_end(late)
        turned_away_in = time.monotonic() - t0
        threads = threading.active_count() - before
        late.close()
        for t in busy:
            t.join()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert turned_away_in < 1 and threads <= 0


def test_many_distinct_requests_leave_the_stores_objects_unchanged(tmp_path):
    (tmp_path / "a.tar").write_bytes(b"x" * 1024)
    before = threading.active_count()

    def requests(first: int, n: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", store.port, timeout=5)
        for k in range(first, first + n):  # distinct paths, query strings and headers: all chosen by the client
            conn.request("GET", f"/missing-{k}.tar?q={k}", headers={f"X-H{k}": str(k)})
            assert conn.getresponse().read() == b"404\n"
        conn.close()
        assert wait_for(lambda: threading.active_count() == before + 1, 5)  # only the accept loop is left

    with FileStore(str(tmp_path), remember=False) as store:
        store.max_paths = 50
        requests(0, 100)
        held = objects_reachable_from(store)
        requests(100, 300)
        grown = objects_reachable_from(store) - held
    assert grown == 0, f"300 distinct requests left {grown} more objects in the store"


def test_a_request_head_past_the_bound_is_refused():
    # 90 headers of 1000 bytes each: under http.server's own limits (100 lines of 64 KiB), over the 64 KiB bound
    with metrics_server() as server:
        big = connect(server)
        headers = b"".join(b"X-H%d: %s\r\n" % (k, b"a" * 1000) for k in range(90))
        head = b"GET /metrics HTTP/1.1\r\nConnection: close\r\n" + headers
        try:
            big.sendall(head + b"\r\n")
        except ConnectionError:
            pass
        answer = read_to_end(big)
        big.close()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def test_a_timeout_or_cap_that_cannot_work_is_refused_naming_the_setting(tmp_path):
    for limits, word in (({"timeout": 0}, "timeout"), ({"max_connections": 0}, "max_connections")):
        with pytest.raises(ValueError, match=word):
            metrics_server(**limits).close()
        with pytest.raises(ValueError, match=word):
            FileStore(str(tmp_path), **limits).close()


def test_the_sampler_replaces_a_kept_alive_connection_the_store_timed_out_without_counting_an_error(tmp_path):
    from helpers import id_shards

    from feedline.sampler.settings import SidecarSettings
    from feedline.sampler.sidecar import Sidecar

    id_shards(str(tmp_path / "src"), shards=2, per_shard=4)
    with FileStore(str(tmp_path / "src"), timeout=0.5) as store:
        (tmp_path / "src" / "index.txt").write_text("ids-0000.tar\nids-0001.tar\n")
        sidecar = Sidecar(SidecarSettings(source=f"{store.url}/index.txt", cache=str(tmp_path / "cache"),
                                          budget=16 << 20, retries=0))
        first, second = sidecar.shards
        sidecar.fetcher.http.get(first, str(tmp_path / "a"), 1 << 20)
        time.sleep(1.0)  # the store closes the idle kept-alive connection meanwhile
        assert sidecar.fetcher.http.get(second, str(tmp_path / "b"), 1 << 20) > 0  # no FetchError("connection")


def _read_slowly(sock: socket.socket, rate: int, seconds: float) -> tuple[int, bool]:
    """Read at about ``rate`` bytes/s for at most ``seconds``: (bytes read, whether the server closed first)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's sends wait on us
    got, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            chunk = sock.recv(max(1, rate // 10))
        except ConnectionError:
            return got, True
        if not chunk:
            return got, True
        got += len(chunk)
        time.sleep(0.1)
    return got, False


def test_a_client_reading_a_shard_below_the_floor_gives_its_connection_back(tmp_path):
    (tmp_path / "big.tar").write_bytes(b"\0" * (32 << 20))
    with FileStore(str(tmp_path), min_client_rate=256 << 10, floor_window=1.0) as store:
        slow = connect(store)
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.sendall(b"GET /big.tar HTTP/1.1\r\nHost: x\r\n\r\n")
        got, closed = _read_slowly(slow, 8 << 10, 8.0)  # 8 KiB/s: a 32 MiB shard would take over an hour
        assert closed and got < (4 << 20) and store.too_slow == 1
        slow.close()
        with urllib.request.urlopen(f"{store.url}/big.tar", timeout=30) as r:  # a reader at full speed is served
            assert len(r.read()) == 32 << 20
        assert store.too_slow == 1


def test_a_floor_of_zero_lets_a_client_read_at_any_rate(tmp_path):
    (tmp_path / "a.tar").write_bytes(b"x" * (1 << 20))
    with FileStore(str(tmp_path), min_client_rate=0, floor_window=0.2) as store:  # no floor: read at any rate
        s = connect(store)
        s.sendall(b"GET /a.tar HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got, closed = _read_slowly(s, 64 << 10, 1.5)
        assert not closed and store.too_slow == 0
        s.close()
