"""An object store's listing is read within a bound (issue 62): botocore reads each ListObjectsV2 page whole, and a
store may send one huge page or pages without end. A stub S3 endpoint on 127.0.0.1 does both."""

import http.server
import threading

import pytest

from feedline.sampler.s3 import PAGE_COST, S3Client, S3Error


class _Stub(http.server.BaseHTTPRequestHandler):
    page_keys = 3  # objects a page lists
    huge = 0  # bytes of padding in every page (a store that answers a page with megabytes)
    endless = False  # every page says there is another
    pages = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        cls = type(self)
        cls.pages += 1
        n = cls.pages
        keys = "".join(f"<Contents><Key>s/shard-{n:06d}-{k}.tar</Key><Size>10</Size></Contents>"
                       for k in range(cls.page_keys))
        more = (f"<IsTruncated>true</IsTruncated><NextContinuationToken>t{n}</NextContinuationToken>"
                if cls.endless else "<IsTruncated>false</IsTruncated>")
        pad = f"<!--{'x' * cls.huge}-->" if cls.huge else ""
        body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                f'2006-03-01/"><Name>b</Name><Prefix>s/</Prefix><KeyCount>{cls.page_keys}</KeyCount>'
                f"<MaxKeys>1000</MaxKeys>{more}{keys}{pad}</ListBucketResult>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def stub(monkeypatch):
    class Handler(_Stub):
        pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for name, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_DEFAULT_REGION", "us-east-1"),
                        ("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")):
        monkeypatch.setenv(name, value)
    yield Handler
    server.shutdown()
    server.server_close()


def test_a_listing_within_its_bound_lists_every_object(stub):
    objects = S3Client(retries=0).list("s3://b/s/")
    assert [o.key for o in objects] == [f"s/shard-000001-{k}.tar" for k in range(3)]


def test_a_page_larger_than_the_listing_may_take_is_refused_naming_the_setting(stub):
    stub.huge = 4 << 20  # a 4 MB page, where the listing may take 1 MB
    with pytest.raises(S3Error, match="passed max_index_bytes=1048576 bytes after 0 page") as exc:
        S3Client(retries=0, max_list_bytes=1 << 20).list("s3://b/s/")
    assert exc.value.reason == "too_large" and stub.pages == 1


def test_pages_without_end_stop_at_the_bound(stub):
    stub.endless = True
    with pytest.raises(S3Error, match="max_index_bytes=409600 .* after 100 page"):
        S3Client(retries=0, max_list_bytes=100 * PAGE_COST).list("s3://b/s/")
    assert stub.pages == 101  # the one past the bound asked for, its answer not read
