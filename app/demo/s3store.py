"""A local S3-compatible server standing in for an object store: ``moto`` in server mode on 127.0.0.1.

With ``auth=True`` requests are checked like AWS's: the server makes an IAM user
and access key at start, and only that key is let in (wrong keys get
``InvalidAccessKeyId`` / 403). Used by the tests and the benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

from .procs import free_port, stop_process

SETUP_REQUESTS = 3  # create_user, put_user_policy, create_access_key: unchecked, then every request is


class S3Store:
    """``moto_server`` on a free port with one bucket; ``close()`` stops it."""

    def __init__(self, bucket: str, auth: bool = False, start_timeout: float = 30.0):
        import boto3

        self.bucket = bucket
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(SETUP_REQUESTS)
        server = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env)
        try:
            self._wait_up(start_timeout)
            self.key_id, self.secret = "testing", "testing"
            if auth:
                self.key_id, self.secret = self._make_key(boto3)
            self.client: Any = boto3.client("s3", **self.client_args())
            self.client.create_bucket(Bucket=bucket)
        except BaseException:
            self.close()
            raise

    def _wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not answer on {self.url} within {timeout:.0f} s") from None
                time.sleep(0.1)

    def _make_key(self, boto3: Any) -> tuple[str, str]:
        iam = boto3.client("iam", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def client_args(self) -> dict[str, str]:
        """Keyword arguments of ``boto3.client("s3", ...)`` for this server."""
        return {"endpoint_url": self.url, "region_name": "us-east-1", "aws_access_key_id": self.key_id,
                "aws_secret_access_key": self.secret}

    def env(self, **change: str) -> dict[str, str]:
        """The standard AWS configuration for a client of this server, and nothing of this machine's own."""
        env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret,
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
               "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true"}
        env.update(change)
        return env

    def upload(self, directory: str, prefix: str, names: list[str] | None = None) -> list[str]:
        """Files of ``directory`` under ``prefix/``; their keys."""
        keys = []
        for name in names if names is not None else sorted(os.listdir(directory)):
            keys.append(f"{prefix}/{name}")
            self.client.upload_file(os.path.join(directory, name), self.bucket, keys[-1])
        return keys

    def close(self) -> None:
        stop_process(self.proc, "moto_server", timeout=10)

    def __enter__(self) -> "S3Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
