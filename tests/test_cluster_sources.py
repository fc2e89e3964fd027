"""Adapter sources and the replica's disk tier without Ray: directory and S3 digests change
exactly when the content does (S3 through moto's in-process mock), fetches land whole, the disk
tier keeps to its byte budget least recently used first and never evicts an adapter in use, and
a replica re-registers an adapter with its daemon when, and only when, its digest moves."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from loraplex.cluster.catalog import Catalog, split_location
from loraplex.cluster.disk_tier import DiskTier
from loraplex.cluster.replica_adapters import ReplicaAdapters
from loraplex.cluster.sources import DirectorySource, S3Source, SourceError, open_source

FILES = ("adapter_config.json", "adapter_model.safetensors")


def _write(d: Path, payload: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / FILES[0]).write_text(json.dumps({"r": len(payload)}))
    (d / FILES[1]).write_bytes(payload)
    return d


def test_directory_source_digest_follows_content(tmp_path: Path) -> None:
    src = DirectorySource(tmp_path)
    _write(tmp_path / "a", os.urandom(256))
    first = src.digest("a")
    assert src.digest("a") == first
    _write(tmp_path / "a", os.urandom(256))
    second = src.digest("a")
    assert second != first
    assert src.fetch("a", tmp_path / "copy") == second
    with pytest.raises(SourceError):
        src.digest("missing")
    with pytest.raises(SourceError):
        src.digest("../etc")


def test_s3_source_digest_and_fetch(tmp_path: Path) -> None:
    moto = pytest.importorskip("moto")
    import boto3

    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="bkt")
        src = S3Source("s3://bkt/pre/fix", client=s3)
        payload = os.urandom(512)
        local = _write(tmp_path / "src", payload)
        for f in FILES:
            s3.upload_file(str(local / f), "bkt", f"pre/fix/one/{f}")
        first = src.digest("one")
        assert src.fetch("one", tmp_path / "got") == first
        assert (tmp_path / "got" / FILES[1]).read_bytes() == payload
        s3.put_object(Bucket="bkt", Key=f"pre/fix/one/{FILES[1]}", Body=os.urandom(512))
        assert src.digest("one") != first
        with pytest.raises(SourceError):
            src.digest("two")
    with pytest.raises(ValueError):
        S3Source("s3://", client=object())
    with pytest.raises(ValueError):
        open_source("gs://bucket/x")


def _write_bin(d: Path, payload: bytes) -> Path:
    """A .bin-only adapter (the bytes are never unpickled here: sources copy and hash them)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / FILES[0]).write_text(json.dumps({"r": len(payload)}))
    (d / "adapter_model.bin").write_bytes(payload)
    return d


def test_a_bin_only_adapter_is_found_copied_and_hashed(tmp_path: Path) -> None:
    src = DirectorySource(tmp_path / "shared")
    payload = os.urandom(300)
    _write_bin(tmp_path / "shared" / "b", payload)
    digest = src.digest("b")
    assert src.fetch("b", tmp_path / "copy") == digest
    assert (tmp_path / "copy" / "adapter_model.bin").read_bytes() == payload
    assert not (tmp_path / "copy" / FILES[1]).exists()
    moto = pytest.importorskip("moto")
    import boto3

    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="bkt")
        remote = S3Source("s3://bkt", client=s3)
        for f in (FILES[0], "adapter_model.bin"):
            s3.upload_file(str(tmp_path / "shared" / "b" / f), "bkt", f"b/{f}")
        first = remote.digest("b")
        assert remote.fetch("b", tmp_path / "got") == first
        assert (tmp_path / "got" / "adapter_model.bin").read_bytes() == payload
        s3.upload_file(str(tmp_path / "shared" / "b" / FILES[0]), "bkt", f"c/{FILES[0]}")
        with pytest.raises(SourceError, match="no adapter weights"):
            remote.digest("c")  # a config without any weights file


def test_disk_tier_lru_within_budget(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "tier", capacity_bytes=3000)

    def fetcher(digest: str, size: int):
        def fetch(tmp: Path) -> str:
            (tmp / "w").write_bytes(os.urandom(size))
            return digest
        return fetch

    for d in ("a", "b"):
        tier.get(d, fetcher(d, 1000))
    assert tier.get("a", fetcher("a", 1000))[0].is_dir() and tier.hits == 1  # a is now the most recent
    _, _, evicted = tier.get("c", fetcher("c", 1500), in_use=lambda d: False)
    assert evicted == ["b"] and not (tmp_path / "tier" / "b").exists() and tier.used <= 3000
    _, _, evicted = tier.get("d", fetcher("d", 1500), in_use=lambda d: d == "a")
    assert evicted == ["c"] and (tmp_path / "tier" / "a").is_dir()
    # a fetch that fails leaves nothing behind
    def broken(tmp: Path) -> str:
        (tmp / "w").write_bytes(b"half")
        raise OSError("connection reset")
    with pytest.raises(OSError):
        tier.get("e", broken)
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == ["a", "d"]


class FakeAdmin:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def add_adapter(self, name, path, *, replace=False, timeout=None):
        self.calls.append(("add", name, Path(path).name, replace))
        return {}

    async def remove_adapter(self, name, *, timeout=None):
        self.calls.append(("remove", name))
        return {}


def test_replica_reregisters_only_when_the_digest_moves(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    src = DirectorySource(root)
    _write(root / "x", os.urandom(128))
    admin = FakeAdmin()
    adapters = ReplicaAdapters(admin, DiskTier(tmp_path / "tier", 1 << 20), busy=set)  # type: ignore[arg-type]

    async def run() -> None:
        ref = {"root": str(root), "key": "x", "digest": src.digest("x")}
        await adapters.ensure("cx", ref)
        await adapters.ensure("cx", ref)  # same content: nothing to do
        _write(root / "x", os.urandom(128))
        ref2 = {**ref, "digest": src.digest("x")}
        await asyncio.gather(adapters.ensure("cx", ref2), adapters.ensure("cx", ref2))  # fetched once
        await adapters.sync({"epoch": 3, "removed": ["cx"]})
        await adapters.sync({"epoch": 3, "removed": ["cx"]})  # applied once

    asyncio.run(run())
    first, second = ref_digests = [c[2] for c in admin.calls if c[0] == "add"]
    assert len(ref_digests) == 2 and first != second and all(c[3] for c in admin.calls if c[0] == "add")
    assert admin.calls[-1] == ("remove", "cx") and sum(c[0] == "remove" for c in admin.calls) == 1


def test_catalog_and_locations() -> None:
    assert split_location("s3://b/p/q/name") == ("s3://b/p/q", "name")
    assert split_location("/data/adapters/name/") == ("/data/adapters", "name")
    for bad in ("s3://bucket", "name", "/x/../"):
        with pytest.raises(ValueError):
            split_location(bad)
    cat = Catalog()
    cat.register("a", "/r", "a")
    cat.remove("a")
    assert cat.view()["removed"] == ["a"] and cat.view()["entries"] == {} and cat.epoch == 2
    cat.register("a", "/r", "a2")
    assert cat.view()["removed"] == [] and cat.view()["entries"] == {"a": ["/r", "a2"]}


def test_orphaned_replica_directories_are_swept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from loraplex.cluster.daemon_child import OWNER_FILE, PREFIX, sweep_orphans

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan, live, foreign = tmp_path / f"{PREFIX}a", tmp_path / f"{PREFIX}b", tmp_path / f"{PREFIX}c"
    for d in (orphan, live, foreign):
        d.mkdir()
    (orphan / OWNER_FILE).write_text(dead.stdout.strip())
    (live / OWNER_FILE).write_text(str(os.getppid()))
    assert sweep_orphans(tmp_path) == [orphan]
    assert not orphan.exists() and live.exists() and foreign.exists()
