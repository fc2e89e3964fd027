"""Where adapters named cluster-wide live: a shared directory (DIR/NAME/ holds the PEFT files)
or an S3-compatible store (s3://bucket/prefix/NAME/<file>, through boto3; the endpoint comes
from boto3's own settings, e.g. AWS_ENDPOINT_URL). Each answers, for a name, a digest of the
adapter's current content (`digest`) and copies the files into a local directory (`fetch`).

An adapter is its config and one weights file: adapter_model.safetensors, else
adapter_model.bin (the engine loads a .bin with torch's restricted unpickler).
Directory digests are the daemon's own content hash (daemon/adapter_hash.py), recomputed only
when the files' sizes or times change; S3 digests hash the objects' ETags (the store's content
hash of each object), so a replaced adapter gets a new digest either way. Blocking calls:
callers run them in a thread.
"""
from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path
from typing import Protocol

from loraplex.contracts.names import is_valid_name
from loraplex.daemon.adapter_hash import adapter_content_hash, adapter_fingerprint
from loraplex.ipc.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHT_FILES, weights_file_name

MAX_ADAPTER_FILE_BYTES = 8 << 30  # one adapter file; a larger object is refused before download


class SourceError(Exception):
    """The adapter is not in the source, or the source cannot be read."""


class AdapterSource(Protocol):
    uri: str

    def locate(self, name: str) -> str: ...

    def digest(self, name: str) -> str: ...

    def fetch(self, name: str, dest: Path) -> str: ...


def _check(name: str) -> None:
    if not is_valid_name(name):
        raise SourceError(f"{name!r} is not a valid adapter name")


class DirectorySource:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)
        self._hashes: dict[str, tuple[tuple, str]] = {}  # name -> (fingerprint, content hash)
        self._lock = threading.Lock()

    def locate(self, name: str) -> str:
        _check(name)
        return str(self.root / name)

    def digest(self, name: str) -> str:
        path = Path(self.locate(name))
        fingerprint = adapter_fingerprint(path)
        if len(fingerprint) != 2:  # the config and a weights file
            raise SourceError(f"no adapter {name!r} under {self.root}")
        with self._lock:
            known = self._hashes.get(name)
        if known is not None and known[0] == fingerprint:
            return known[1]
        content = adapter_content_hash(path)
        if not content:
            raise SourceError(f"no adapter {name!r} under {self.root}")
        with self._lock:
            self._hashes[name] = (fingerprint, content)
        return content

    def fetch(self, name: str, dest: Path) -> str:
        """A shared directory is read where it is: copy into `dest` all the same, so the daemon
        reads a snapshot that a later replacement cannot change under it."""
        src = Path(self.locate(name))
        dest.mkdir(parents=True, exist_ok=True)
        for file in (ADAPTER_CONFIG, weights_file_name(src)):
            shutil.copyfile(src / file, dest / file)
        content = adapter_content_hash(dest)
        if not content:
            raise SourceError(f"the adapter {name!r} changed while it was copied")
        return content


class S3Source:
    def __init__(self, uri: str, client: object | None = None) -> None:
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not uri.startswith("s3://") or not bucket:
            raise ValueError(f"an S3 adapter source is s3://bucket[/prefix], got {uri!r}")
        self.uri, self.bucket, self.prefix = uri, bucket, prefix.strip("/")
        if client is None:
            import boto3  # the `cluster` extra

            client = boto3.client("s3")
        self._s3 = client

    def _key(self, name: str, file: str) -> str:
        return "/".join(p for p in (self.prefix, name, file) if p)

    def locate(self, name: str) -> str:
        _check(name)
        return f"s3://{self.bucket}/{self._key(name, '')}"

    def _head(self, name: str, file: str) -> dict:
        return self._s3.head_object(Bucket=self.bucket, Key=self._key(name, file))  # type: ignore[attr-defined]

    def _heads(self, name: str) -> dict[str, dict]:
        """The config's and the weights file's heads (safetensors first, else .bin), in that order."""
        _check(name)
        try:
            heads = {ADAPTER_CONFIG: self._head(name, ADAPTER_CONFIG)}
        except Exception as exc:  # botocore's ClientError (404) or a connection failure
            raise SourceError(f"no adapter {name!r} at {self.locate(name)} ({exc})") from None
        for file in ADAPTER_WEIGHT_FILES:
            try:
                heads[file] = self._head(name, file)
                break
            except Exception as exc:
                missing = exc
        else:
            raise SourceError(f"no adapter weights for {name!r} at {self.locate(name)} ({missing})") from None
        for file, head in heads.items():
            if head.get("ContentLength", 0) > MAX_ADAPTER_FILE_BYTES:
                raise SourceError(f"{self._key(name, file)} is larger than {MAX_ADAPTER_FILE_BYTES} bytes")
        return heads

    def digest(self, name: str) -> str:
        return _etag_digest(self._heads(name))

    def fetch(self, name: str, dest: Path) -> str:
        """Download the files; the digest of what was downloaded (each object is fetched at the
        ETag its head reported, so a replacement racing the download is detected)."""
        heads = self._heads(name)
        dest.mkdir(parents=True, exist_ok=True)
        for file in heads:
            try:
                body = self._s3.get_object(Bucket=self.bucket, Key=self._key(name, file),  # type: ignore[attr-defined]
                                           IfMatch=heads[file]["ETag"])["Body"]
                with (dest / file).open("wb") as out:
                    shutil.copyfileobj(body, out, 1 << 20)
            except Exception as exc:
                raise SourceError(f"downloading {self._key(name, file)} failed: {exc}") from None
        return _etag_digest(heads)


def _etag_digest(heads: dict[str, dict]) -> str:
    digest = hashlib.sha256()
    for file in heads:  # config, then the one weights file
        digest.update(f"{file}\0{heads[file].get('ETag', '')}\0{heads[file].get('ContentLength', 0)}\0".encode())
    return digest.hexdigest()


def open_source(uri: str) -> AdapterSource:
    """The source `uri` names: s3://bucket/prefix or a directory."""
    if uri.startswith("s3://"):
        return S3Source(uri)
    if "://" in uri:
        raise ValueError(f"unsupported adapter source {uri!r}; use a directory or s3://bucket/prefix")
    if not Path(uri).expanduser().is_dir():
        raise ValueError(f"adapter source {uri} is not a directory")
    return DirectorySource(uri)
