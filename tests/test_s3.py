"""s3:// sources against a real S3-compatible server (moto in server mode) on 127.0.0.1, with credentials checked."""

import os
import subprocess
import sys

import pytest
from helpers import KEPT_FOR_THE_MODULE, ROOT, id_shards, manifest_ids, wait_for, write_tar
from helpers import cached_ids as all_ids
from helpers import store_sampler as sampler

from feedline.demo.procs import free_port
from feedline.demo.s3store import S3Store

BUCKET = "feedline-data"

# in one xdist worker: one S3 server for the module
pytestmark = pytest.mark.xdist_group("s3")
SHARDS = 6


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible server on 127.0.0.1, checking credentials like AWS: one for the module (each test's
    objects under keys of their own; the shards' are the same each time)."""
    with S3Store(BUCKET, auth=True) as server:
        KEPT_FOR_THE_MODULE.add(server.proc.pid)
        yield server
    KEPT_FOR_THE_MODULE.discard(server.proc.pid)
    assert server.proc.poll() is not None, "the S3 server outlived its module"


@pytest.fixture
def s3_shards(s3, tmp_path):
    """SHARDS id shards of 20 samples under s3://feedline-data/train/, and a file that is no shard."""
    src = tmp_path / "src"
    id_shards(str(src), shards=SHARDS, per_shard=20, payload=2048)
    (src / "README.md").write_text("not a shard")
    s3.upload(src, "train")
    s3.client.put_object(Bucket=BUCKET, Key="other/ids-9999.tar", Body=open(src / "ids-0000.tar", "rb").read())
    return src


def test_a_brace_list_of_keys_fills_the_cache_and_every_sample_reaches_the_loader(s3, s3_shards, cache, samplers):
    s = sampler(s3, cache, f"s3://{BUCKET}/train/ids-{{0000..{SHARDS - 1:04d}}}.tar", samplers)
    assert wait_for(lambda: len(manifest_ids(cache)) == SHARDS, 30), s.stop()
    assert s.stop() is not None and s.proc.returncode == 0
    assert all_ids(cache) == list(range(SHARDS * 20))


def test_a_prefix_lists_every_shard_under_it_and_nothing_else(s3, s3_shards, cache, samplers):
    s = sampler(s3, cache, f"s3://{BUCKET}/train/", samplers)
    assert wait_for(lambda: len(manifest_ids(cache)) == SHARDS, 30), s.stop()
    s.stop()
    assert sorted(manifest_ids(cache)) == [f"ids-{k:04d}" for k in range(SHARDS)]


def test_a_shard_larger_than_a_part_arrives_whole_through_ranged_gets(s3, cache, samplers, tmp_path):
    from feedline.sampler.s3 import PART

    big = write_tar(str(tmp_path / "big-0000.tar"), [(f"k{i}", {"bin": os.urandom(PART // 4)}) for i in range(6)])
    s3.client.upload_file(big, BUCKET, "big/big-0000.tar")
    s = sampler(s3, cache, f"s3://{BUCKET}/big/big-0000.tar", samplers)
    assert wait_for(lambda: manifest_ids(cache) == ["big-0000"], 60), s.stop()
    s.stop()
    with open(big, "rb") as a, open(os.path.join(cache, "shards", "big-0000.tar"), "rb") as b:
        assert a.read() == b.read()


def refusal(s3, cache, source, **env):
    out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source", source, "--cache", cache,
                          "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **s3.env(**env)})
    assert out.returncode == 2, out.stdout + out.stderr
    return out.stderr


def test_no_credentials_are_refused_naming_where_they_come_from(s3, s3_shards, cache):
    env = s3.env()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(name)
    saved = {k: os.environ.pop(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if k in os.environ}
    try:
        out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source",
                              f"s3://{BUCKET}/train/ids-0000.tar", "--cache", cache, "--metrics-port", "0"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    finally:
        os.environ.update(saved)
    assert out.returncode == 2
    assert "no AWS credentials" in out.stderr and "AWS_ACCESS_KEY_ID" in out.stderr


@pytest.mark.parametrize("source", [f"s3://{BUCKET}/train/ids-{{0000..0001}}.tar", f"s3://{BUCKET}/train/"])
def test_wrong_credentials_are_refused_as_access_denied(s3, s3_shards, cache, source):
    err = refusal(s3, cache, source, AWS_ACCESS_KEY_ID="AKIAWRONGWRONGWRONG0", AWS_SECRET_ACCESS_KEY="nope")
    assert "access denied" in err and BUCKET in err


@pytest.mark.parametrize("source", ["s3://no-such-bucket/train/ids-{0000..0001}.tar", "s3://no-such-bucket/train/"])
def test_a_bucket_that_does_not_exist_is_named(s3, cache, source):
    err = refusal(s3, cache, source)
    assert "no such bucket" in err and "no-such-bucket" in err


def test_a_prefix_with_no_shards_is_refused(s3, s3_shards, cache):
    err = refusal(s3, cache, f"s3://{BUCKET}/nothing-here/")
    assert "no shard under this prefix" in err


def test_keys_that_do_not_exist_are_refused(s3, s3_shards, cache):
    err = refusal(s3, cache, f"s3://{BUCKET}/train/wrong-{{0000..0003}}.tar")
    assert "none of the first" in err and "wrong-0000.tar" in err


def test_an_unreachable_endpoint_is_refused_naming_aws_endpoint_url(s3, cache):
    err = refusal(s3, cache, f"s3://{BUCKET}/train/ids-0000.tar", AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")
    assert "unreachable" in err and "AWS_ENDPOINT_URL" in err
