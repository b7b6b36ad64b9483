"""Where the network keeps uploads, datasets, logs and job artifacts.

One interface, two backends: a local folder (the embedded default) and an S3-compatible bucket
through boto3 (settings.STORAGE_URL = "s3://bucket/prefix"). Keys are relative, '/'-separated
paths below the storage's root or prefix.

Dataset files are content-addressed blobs (blob_key(sha256)): the same bytes are kept once,
however many datasets, versions or jobs use them.

Over 500 lines because the two backends (a local folder, an S3 bucket) implement one interface and
are read side by side: a behaviour one has the other must have too.
"""

import hashlib
import http.client
import os
import shutil
import tempfile
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from django.conf import settings

CHUNK = 1024 * 1024


class StorageError(Exception):
    pass


class NotFound(StorageError):
    pass


class RangeNotSatisfiable(StorageError):
    """The object is shorter than the range asked for (it changed, or the manifest is wrong)."""


def check_key(key):
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in key:
        raise StorageError(f"invalid storage key {key!r}")
    return key


BLOBS = "blobs/"


def blob_key(sha256):
    return f"blobs/sha256/{sha256[:2]}/{sha256}"


class HashingReader:
    """Wraps a binary stream, counting and hashing what is read through it."""

    def __init__(self, stream):
        self.stream = stream
        self.digest = hashlib.sha256()
        self.size = 0

    def read(self, n=-1):
        data = self.stream.read(n)
        self.digest.update(data)
        self.size += len(data)
        return data

    @property
    def sha256(self):
        return self.digest.hexdigest()


class Storage:
    """What every backend offers; shared helpers are written once, here."""

    def save_file(self, key, src_path):
        with open(src_path, "rb") as src:
            return self.save(key, src)

    def save_blob(self, fileobj):
        """Keep the bytes once, under their SHA-256; returns (key, size, sha256)."""
        with tempfile.TemporaryFile() as spool:
            reader = HashingReader(fileobj)
            shutil.copyfileobj(reader, spool, CHUNK)
            key = blob_key(reader.sha256)
            try:
                # Kept already: touched, so that the blob sweep (jobs/sweep.py) sees it young
                # until the row about to refer to it is written.
                self.touch(key)
            except NotFound:
                spool.seek(0)
                self.save(key, spool)
            return key, reader.size, reader.sha256

    @contextmanager
    def local_copy(self, key):
        """A local path holding the object's bytes for the duration of the block."""
        path = self.local_path(key)
        if path is not None:
            if not path.is_file():
                raise NotFound(key)
            yield path
            return
        with tempfile.TemporaryDirectory() as folder:
            dest = Path(folder) / "object"
            self.download(key, dest)
            yield dest


class LocalStorage(Storage):
    kind = "local"

    def __init__(self, root):
        self.root = Path(root)

    def path(self, key):
        return self.root / check_key(key)

    def local_path(self, key):
        return self.path(key)

    def save(self, key, fileobj):
        """Write fileobj under key; return (size, sha256). The file appears whole or not at all."""
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        reader = HashingReader(fileobj)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(reader, out, CHUNK)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return reader.size, reader.sha256

    def open(self, key):
        try:
            return open(self.path(key), "rb")
        except FileNotFoundError:
            raise NotFound(key) from None

    def exists(self, key):
        return self.path(key).is_file()

    def size(self, key):
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(key) from None

    def download(self, key, dest_path):
        dest_path = Path(dest_path)
        dest_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(self.path(key), dest_path)
        except FileNotFoundError:
            raise NotFound(key) from None

    def delete(self, key):
        self.path(key).unlink(missing_ok=True)

    def copy(self, src_key, dst_key):
        """dst_key gets src_key's bytes without reading them: a hard link (a copy where the file
        system has none). Objects here are only ever replaced whole, never written in place, so
        two keys may share one file. The copy appears whole or not at all, modified now (as a
        copy in S3 is)."""
        src, dest = self.path(src_key), self.path(dst_key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".part-{os.urandom(8).hex()}"
        try:
            try:
                os.link(src, tmp)
            except FileNotFoundError:
                raise NotFound(src_key) from None
            except OSError:
                shutil.copyfile(src, tmp)
            os.utime(tmp)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def last_modified(self, key):
        try:
            return _aware(self.path(key).stat().st_mtime)
        except FileNotFoundError:
            raise NotFound(key) from None

    def touch(self, key):
        """Mark the object as just used (its last-modified time becomes now); NotFound if absent."""
        try:
            os.utime(self.path(key))
        except FileNotFoundError:
            raise NotFound(key) from None

    def list_blobs(self):
        """(key, size, last modified) of every file under blobs/, partial writes included."""
        top = self.root / BLOBS
        for folder, _, names in os.walk(top):
            for name in names:
                path = Path(folder) / name
                try:
                    stat = path.stat()
                except FileNotFoundError:  # deleted while we walked
                    continue
                yield path.relative_to(self.root).as_posix(), stat.st_size, _aware(stat.st_mtime)

    def presigned_url(self, key, filename, expires=300):
        return None  # served by the app itself, with Range support

    # Chunked uploads: parts are files in a folder, joined on completion.

    def start_multipart(self, key):
        upload_id = os.urandom(16).hex()
        (self.root / ".multipart" / upload_id).mkdir(parents=True)
        return upload_id

    def put_part(self, key, upload_id, number, data):
        folder = self.root / ".multipart" / check_key(upload_id)
        if not folder.is_dir():
            raise NotFound(f"upload {upload_id}")
        tmp = folder / f".{number:06d}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, folder / f"{number:06d}")
        return hashlib.md5(data, usedforsecurity=False).hexdigest()

    def complete_multipart(self, key, upload_id, parts):
        folder = self.root / ".multipart" / check_key(upload_id)
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".part-")
        with os.fdopen(fd, "wb") as out:
            for number, _etag in parts:
                with open(folder / f"{number:06d}", "rb") as part:
                    shutil.copyfileobj(part, out, CHUNK)
        os.replace(tmp, dest)
        shutil.rmtree(folder, ignore_errors=True)

    def abort_multipart(self, key, upload_id):
        shutil.rmtree(self.root / ".multipart" / check_key(upload_id), ignore_errors=True)


class S3Storage(Storage):
    """An S3-compatible bucket (AWS, SeaweedFS, MinIO...) through boto3."""

    kind = "s3"

    def __init__(self, bucket, prefix="", endpoint_url=None, access_key=None, secret_key=None, region="us-east-1", public_endpoint_url=None, concurrency=8):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        options = {
            "endpoint_url": endpoint_url,
            "aws_access_key_id": access_key,
            "aws_secret_access_key": secret_key,
            "region_name": region,
            # Room for a runner's stagings (several at once, each with its workers) and uploads.
            "config": Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"max_attempts": 5, "mode": "standard"},
                max_pool_connections=max(32, concurrency * 4),
            ),
        }
        self.client = boto3.client("s3", **options)
        # Presigned URLs are for the browser, which may reach the store at another address.
        self.public_client = boto3.client("s3", **{**options, "endpoint_url": public_endpoint_url or endpoint_url})
        # Large objects move as parallel ranged parts.
        self.transfer = TransferConfig(multipart_threshold=16 * CHUNK, multipart_chunksize=16 * CHUNK, max_concurrency=concurrency)

    def _key(self, key):
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def open_range(self, key, start=0, end=None):
        """A RangeStream of the object's bytes [start, end) (all of them by default), with the
        object's whole size; what staging reads large files with, in parallel parts."""
        try:
            return s3_open_range(self.client, self.bucket, self._key(key), start, end)
        except NotFound:
            raise NotFound(key) from None

    def local_path(self, key):
        return None

    def _missing(self, error):
        from botocore.exceptions import ClientError

        return isinstance(error, ClientError) and error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")

    def save(self, key, fileobj):
        reader = HashingReader(fileobj)
        self.client.upload_fileobj(reader, self.bucket, self._key(key), Config=self.transfer)
        return reader.size, reader.sha256

    def open(self, key):
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except Exception as error:
            if self._missing(error):
                raise NotFound(key) from None
            raise

    def exists(self, key):
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as error:
            if self._missing(error):
                return False
            raise

    def size(self, key):
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
        except Exception as error:
            if self._missing(error):
                raise NotFound(key) from None
            raise

    def download(self, key, dest_path):
        dest_path = Path(dest_path)
        dest_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(self.bucket, self._key(key), str(dest_path), Config=self.transfer)
        except Exception as error:
            if self._missing(error):
                raise NotFound(key) from None
            raise

    def delete(self, key):
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    # CopyObject copies at most 5 GiB in one request; a larger object is copied in parts of
    # COPY_PART_BYTES (UploadPartCopy), which boto3's managed copy makes bigger where S3's 10,000
    # parts would not be enough.
    COPY_LIMIT = 5 * 1024**3
    COPY_PART_BYTES = 256 * CHUNK

    def _copy_inside(self, src_key, dst_key, extra=None):
        """dst_key gets src_key's bytes, copied inside the store: nothing passes through us.
        extra: more CopyObject arguments. NotFound when src_key is missing."""
        from boto3.s3.transfer import TransferConfig

        source = {"Bucket": self.bucket, "Key": self._key(src_key)}
        try:
            if self.size(src_key) <= self.COPY_LIMIT:
                self.client.copy_object(CopySource=source, Bucket=self.bucket, Key=self._key(dst_key), **(extra or {}))
                return
            config = TransferConfig(
                multipart_threshold=self.COPY_LIMIT, multipart_chunksize=self.COPY_PART_BYTES, max_concurrency=self.transfer.max_concurrency
            )
            self.client.copy(source, self.bucket, self._key(dst_key), ExtraArgs=extra, Config=config)
        except Exception as error:
            if self._missing(error):  # gone between the two requests
                raise NotFound(src_key) from None
            raise

    def copy(self, src_key, dst_key):
        """dst_key gets src_key's bytes without them passing through us: a new object
        (LastModified now)."""
        self._copy_inside(src_key, dst_key)

    def last_modified(self, key):
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["LastModified"]
        except Exception as error:
            if self._missing(error):
                raise NotFound(key) from None
            raise

    def touch(self, key):
        """Mark the object as just used: S3 has no utime, but copying an object onto itself with
        its metadata replaced rewrites it (server-side) with LastModified = now. NotFound if absent."""
        self._copy_inside(key, key, {"MetadataDirective": "REPLACE"})

    def list_blobs(self):
        """(key, size, last modified) of every object under blobs/."""
        start = len(self.prefix) + 1 if self.prefix else 0  # the storage's prefix and its slash
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(BLOBS.rstrip("/")) + "/"):
            for obj in page.get("Contents", []):
                yield obj["Key"][start:], obj["Size"], obj["LastModified"]

    def presigned_url(self, key, filename, expires=300):
        from django.utils.http import content_disposition_header

        return self.public_client.generate_presigned_url(
            "get_object",
            Params={
                "Bucket": self.bucket,
                "Key": self._key(key),
                "ResponseContentDisposition": content_disposition_header(True, filename),
            },
            ExpiresIn=expires,
        )

    def start_multipart(self, key):
        return self.client.create_multipart_upload(Bucket=self.bucket, Key=self._key(key))["UploadId"]

    def put_part(self, key, upload_id, number, data):
        try:
            response = self.client.upload_part(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, PartNumber=number, Body=data)
        except Exception as error:
            if isinstance(error, self.client.exceptions.NoSuchUpload):
                raise NotFound(f"upload {upload_id}") from None
            raise
        return response["ETag"]

    def complete_multipart(self, key, upload_id, parts):
        self.client.complete_multipart_upload(
            Bucket=self.bucket,
            Key=self._key(key),
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etag} for n, etag in parts]},
        )

    def abort_multipart(self, key, upload_id):
        self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)


class RangeStream:
    """The body of one S3 GET, read with readinto() into the caller's buffer.

    botocore's StreamingBody.read() and urllib3's readinto() allocate a fresh bytes object for
    every read (and urllib3 copies it once more): with several downloads at once on a small
    machine that costs as much CPU as hashing the bytes. When the body is a plain http.client
    response under urllib3 (what botocore gives, with decode_content off), this reads straight
    from it into the buffer, and hands the connection back to urllib3's pool at the end;
    otherwise it falls back to the body's own read()."""

    def __init__(self, body, length, object_size):
        self.body = body
        self.length = length  # bytes in this response
        self.object_size = object_size  # bytes in the whole object
        self.received = 0
        raw = getattr(body, "_raw_stream", None)
        fp = getattr(raw, "_fp", None)
        direct = isinstance(fp, http.client.HTTPResponse) and not getattr(raw, "decode_content", False)
        self._raw = raw if direct else None
        self._fp = fp if direct else None

    def readinto(self, buffer):
        if self._fp is not None:
            n = self._fp.readinto(buffer)
        else:
            data = self.body.read(len(buffer))
            n = len(data)
            buffer[:n] = data
        self.received += n
        return n

    def close(self):
        if self._fp is not None and self.received == self.length and self._fp.isclosed():
            self._raw.release_conn()  # read to its end: the connection can serve the next request
        else:
            self.body.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _error_code(error):
    from botocore.exceptions import ClientError

    if isinstance(error, ClientError):
        return error.response.get("Error", {}).get("Code")
    return None


def s3_open_range(client, bucket, key, start=0, end=None):
    """A RangeStream of the object's bytes [start, end); the whole object (no Range header) when
    start is 0 and end is None. Raises NotFound for a missing object and RangeNotSatisfiable when
    the object ends before start."""
    params = {"Bucket": bucket, "Key": key}
    ranged = start != 0 or end is not None
    if ranged:
        params["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    try:
        response = client.get_object(**params)
    except Exception as error:
        code = _error_code(error)
        if code in ("404", "NoSuchKey", "NotFound"):
            raise NotFound(key) from None
        if code in ("416", "InvalidRange"):
            raise RangeNotSatisfiable(key) from None
        raise
    length = response.get("ContentLength")
    content_range = response.get("ContentRange")
    if content_range:  # "bytes 0-1023/4096" ("*" when the store does not say)
        total = content_range.rsplit("/", 1)[1]
        object_size = int(total) if total.isdigit() else None
    elif ranged and not (length is not None and start == 0 and end is not None and length <= end):
        response["Body"].close()
        raise StorageError(f"the store ignored the Range header of a GET of {key}")
    else:
        object_size = length
    return RangeStream(response["Body"], length, object_size)


def _aware(timestamp):
    return datetime.fromtimestamp(timestamp, tz=UTC)


def storage_from_settings(url, directory, s3):
    if url is None:
        return LocalStorage(directory)
    parsed = urlparse(url)
    return S3Storage(bucket=parsed.netloc, prefix=parsed.path, **s3)


@lru_cache(maxsize=4)
def _cached(url, directory, s3_items):
    return storage_from_settings(url, directory, dict(s3_items))


def get_storage():
    s3 = settings.E31_S3
    return _cached(settings.STORAGE_URL, str(settings.STORAGE_DIR), tuple(sorted(s3.items())))
