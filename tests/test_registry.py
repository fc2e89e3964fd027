"""Adapter registry: CRUD with stable error codes, persistence across reopen and
across processes (SQLite WAL), a private state directory, adapter paths that
cannot escape the allowed roots through symlinks, one scope per base model (and
the migration of an unscoped schema-1 registry), recorded identities and uses."""
from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.contracts.names import is_valid_name
from loraplex.daemon.adapter_rules import RegistryError, check_adapter_path
from loraplex.daemon.registry import (
    MIGRATIONS,
    SCHEMA_VERSION,
    AdapterRecord,
    AdapterRegistry,
    RegistrySchemaError,
)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "registry.sqlite3"


@pytest.fixture
def reg(db_path: Path):
    with AdapterRegistry(db_path) as registry:
        yield registry


def test_add_get_list_remove(reg: AdapterRegistry) -> None:
    rec = reg.add("qv-r8", "/srv/a/qv", rank=8, target_modules=("q_proj", "v_proj"), source="cli")
    assert rec == reg.get("qv-r8")
    assert (rec.name, rec.path, rec.rank, rec.target_modules, rec.pinned, rec.source) == (
        "qv-r8", "/srv/a/qv", 8, ("q_proj", "v_proj"), False, "cli")
    assert rec.added_at > 0
    reg.add("b.v2", Path("/srv/b"))
    reg.add("A_0", "/srv/c")
    assert [r.name for r in reg.list()] == ["A_0", "b.v2", "qv-r8"]
    assert reg.get("b.v2").rank is None and reg.get("b.v2").target_modules == ()  # type: ignore[union-attr]
    assert reg.get("missing") is None
    assert reg.remove("b.v2") is True
    assert reg.get("b.v2") is None
    with pytest.raises(RegistryError) as err:
        reg.remove("b.v2")
    assert err.value.code == "not_found" and isinstance(err.value, ValueError)
    assert reg.remove("b.v2", missing_ok=True) is False


def test_record_to_dict(reg: AdapterRegistry) -> None:
    d = reg.add("x", "/x", rank=4, target_modules=["q_proj"]).to_dict()
    assert d == {"name": "x", "path": "/x", "rank": 4, "target_modules": ["q_proj"], "pinned": False,
                 "added_at": d["added_at"], "source": "admin"}
    assert isinstance(d["added_at"], float)


def test_pin_and_unpin(reg: AdapterRegistry) -> None:
    reg.add("a", "/a")
    assert reg.set_pinned("a", True).pinned is True
    assert reg.get("a").pinned is True  # type: ignore[union-attr]
    assert reg.set_pinned("a", False).pinned is False
    with pytest.raises(RegistryError) as err:
        reg.set_pinned("nope", True)
    assert err.value.code == "not_found"


def test_duplicates_and_replace_keeps_pin(reg: AdapterRegistry) -> None:
    first = reg.add("a", "/a", rank=8)
    reg.set_pinned("a", True)
    with pytest.raises(RegistryError, match="already registered") as err:
        reg.add("a", "/other")
    assert err.value.code == "already_exists"
    assert reg.get("a").path == "/a"  # type: ignore[union-attr]
    replaced = reg.add("a", "/other", rank=16, replace=True, source="config")
    assert (replaced.path, replaced.rank, replaced.source, replaced.pinned) == ("/other", 16, "config", True)
    assert replaced.added_at >= first.added_at
    assert len(reg.list()) == 1
    assert reg.add("fresh", "/f", replace=True).name == "fresh"


@pytest.mark.parametrize("name", ["", ".", "..", "a b", "a/b", "é", "x" * 129, "a\x00", None, 3])
def test_invalid_names_are_refused(reg: AdapterRegistry, name: object) -> None:
    assert not is_valid_name(name)
    with pytest.raises(RegistryError) as err:
        reg.add(name, "/a")  # type: ignore[arg-type]
    assert err.value.code == "invalid_field"
    assert reg.list() == []


def test_name_limits_accepted(reg: AdapterRegistry) -> None:
    for name in ("a", "x" * 128, "...", "A-b_c.9"):
        assert is_valid_name(name)
        reg.add(name, "/a")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"path": "relative/dir"}, "must be absolute"),
        ({"path": ""}, "1..4096 characters"),
        ({"path": "/a\x00b"}, "without NUL"),
        ({"rank": 0}, "rank must be a positive integer"),
        ({"rank": True}, "rank must be a positive integer"),
        ({"rank": 8.0}, "rank must be a positive integer"),
        ({"target_modules": "q_proj"}, "not one string"),
        ({"target_modules": ("q_proj", "")}, "non-empty strings"),
        ({"source": "web"}, "source must be one of cli, admin, flag, config"),
    ],
)
def test_invalid_fields_are_refused(reg: AdapterRegistry, kwargs: dict[str, object], fragment: str) -> None:
    args = {"path": "/a", **kwargs}
    path = args.pop("path")
    with pytest.raises(RegistryError, match=fragment) as err:
        reg.add("a", path, **args)  # type: ignore[arg-type]
    assert err.value.code == "invalid_field"
    assert reg.get("a") is None


def test_persists_across_reopen(db_path: Path) -> None:
    with AdapterRegistry(db_path) as reg:
        reg.add("a", "/a", rank=8, target_modules=("q_proj",), source="flag")
        reg.set_pinned("a", True)
        before = reg.list()
    with AdapterRegistry(db_path) as reg:
        assert reg.list() == before
        assert reg.schema_version == SCHEMA_VERSION == 2
        assert reg.get("a") == AdapterRecord("a", "/a", 8, ("q_proj",), True, before[0].added_at, "flag")


def test_closed_registry_raises(db_path: Path) -> None:
    reg = AdapterRegistry(db_path)
    reg.close()
    reg.close()
    with pytest.raises(RuntimeError, match="closed"):
        reg.list()


def test_two_connections_see_each_other(db_path: Path) -> None:
    with AdapterRegistry(db_path) as one, AdapterRegistry(db_path) as two:
        one.add("a", "/a")
        assert two.get("a") is not None
        with pytest.raises(RegistryError) as err:
            two.add("a", "/b")
        assert err.value.code == "already_exists"
        two.set_pinned("a", True)
        assert one.get("a").pinned is True  # type: ignore[union-attr]
        assert one.remove("a") and two.get("a") is None
        con = sqlite3.connect(db_path)
        try:
            assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            con.close()


def test_another_process_writes_concurrently(db_path: Path) -> None:
    code = (
        "import sys\n"
        "from loraplex.daemon.registry import AdapterRegistry\n"
        "with AdapterRegistry(sys.argv[1]) as reg:\n"
        "    for i in range(50):\n"
        "        reg.add(f'child-{i}', f'/c/{i}', source='cli')\n"
    )
    with AdapterRegistry(db_path) as reg:
        child = subprocess.Popen([sys.executable, "-c", code, str(db_path)])
        for i in range(50):
            reg.add(f"parent-{i}", f"/p/{i}")
        assert child.wait(timeout=60) == 0
        names = [r.name for r in reg.list()]
    assert len(names) == 100 and names == sorted(names)


def test_state_dir_and_db_are_private(tmp_path: Path) -> None:
    db = tmp_path / "deep" / "state" / "registry.sqlite3"
    AdapterRegistry(db).close()
    assert stat.S_IMODE(os.stat(db.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600


def test_state_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        AdapterRegistry(shared / "registry.sqlite3")
    assert not (shared / "registry.sqlite3").exists()


def test_newer_schema_is_refused(db_path: Path) -> None:
    AdapterRegistry(db_path).close()
    con = sqlite3.connect(db_path)
    con.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    con.commit()
    con.close()
    with pytest.raises(RegistrySchemaError, match="newer than this loraplex"):
        AdapterRegistry(db_path)


# ---- adapter path checks -----------------------------------------------------------------------


def test_check_adapter_path_inside_roots(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    (root / "qv").mkdir(parents=True)
    assert check_adapter_path(root / "qv", (str(root),)) == (root / "qv").resolve()
    assert check_adapter_path(str(root / "qv"), ()) == (root / "qv").resolve()
    assert check_adapter_path(str(root / "qv" / ".." / "qv"), (str(root),)) == (root / "qv").resolve()


def test_check_adapter_path_refusals(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "file").write_text("x")
    cases = [
        ("relative/dir", "invalid_field", "absolute"),
        (str(root / "missing"), "invalid_field", "does not exist"),
        (str(root / "file"), "invalid_field", "not a directory"),
        (str(outside), "forbidden_path", "outside the allowed adapter directories"),
        (str(root / ".." / "elsewhere"), "forbidden_path", "outside"),
    ]
    for path, code, fragment in cases:
        with pytest.raises(RegistryError, match=fragment) as err:
            check_adapter_path(path, (str(root),))
        assert err.value.code == code, path


def test_symlink_escaping_the_root_is_forbidden(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    root.mkdir()
    secret = tmp_path / "secret"
    secret.mkdir()
    (root / "escape").symlink_to(secret)
    with pytest.raises(RegistryError, match=r"resolves to .*secret") as err:
        check_adapter_path(root / "escape", (str(root),))
    assert err.value.code == "forbidden_path"
    # a sibling directory sharing the root's name as a prefix is not inside it
    (tmp_path / "adapters2").mkdir()
    with pytest.raises(RegistryError) as err:
        check_adapter_path(tmp_path / "adapters2", (str(root),))
    assert err.value.code == "forbidden_path"
    # a symlink that stays inside the roots is fine, and its target is returned
    (root / "real").mkdir()
    (root / "alias").symlink_to(root / "real")
    assert check_adapter_path(root / "alias", (str(root),)) == (root / "real").resolve()


def test_symlinked_root_is_resolved_too(tmp_path: Path) -> None:
    real_root = tmp_path / "real-root"
    (real_root / "a").mkdir(parents=True)
    link_root = tmp_path / "link-root"
    link_root.symlink_to(real_root)
    assert check_adapter_path(link_root / "a", (str(link_root),)) == (real_root / "a").resolve()
    assert check_adapter_path(real_root / "a", (str(link_root),)) == (real_root / "a").resolve()


def test_registry_error_codes_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown registry error code"):
        RegistryError("bogus", "x")


# ---- scopes by base model -------------------------------------------------------------------


def test_each_model_sees_only_its_own_adapters(db_path: Path) -> None:
    with AdapterRegistry(db_path, model="llama-aaaa") as a, AdapterRegistry(db_path, model="qwen2-bbbb") as b:
        a.add("shared-name", "/a/x", rank=8)
        b.add("shared-name", "/b/x", rank=16)  # the same name is free in another scope
        b.add("only-b", "/b/y")
        assert [(r.name, r.path) for r in a.list()] == [("shared-name", "/a/x")]
        assert [r.name for r in b.list()] == ["only-b", "shared-name"]
        assert a.get("only-b") is None and a.count_other_models() == 2
        b.remove("shared-name")
        assert a.get("shared-name").path == "/a/x"  # type: ignore[union-attr]
        with pytest.raises(RegistryError) as err:
            a.set_pinned("only-b", True)
        assert err.value.code == "not_found"


def test_a_schema_1_registry_is_migrated_unscoped_and_claimed_by_name(db_path: Path) -> None:
    """The rows of an old registry keep everything, belong to no model, and move into a model's
    scope one by one when claimed (the daemon claims those whose files load on its model)."""
    db_path.parent.mkdir(mode=0o700)
    con = sqlite3.connect(db_path)
    con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    con.execute("INSERT INTO schema_version VALUES (1)")
    for statement in MIGRATIONS[0]:
        con.execute(statement)
    con.execute("INSERT INTO adapters VALUES ('old', '/srv/old', 8, '[\"q_proj\"]', 1, 12.5, 'cli')")
    con.execute("INSERT INTO adapters VALUES ('clash', '/srv/clash', NULL, '[]', 0, 13.5, 'admin')")
    con.commit()
    con.close()
    with AdapterRegistry(db_path, model="llama-aaaa") as reg:
        assert reg.schema_version == SCHEMA_VERSION and reg.list() == []
        old = next(r for r in reg.unscoped() if r.name == "old")
        assert (old.path, old.rank, old.target_modules, old.pinned, old.added_at, old.source) == (
            "/srv/old", 8, ("q_proj",), True, 12.5, "cli")
        reg.add("clash", "/mine/clash")
        assert reg.claim("clash") is None  # this model has its own: the unscoped one stays for another
        assert reg.claim("old") == old and reg.get("old") == old and reg.claim("old") is None
        assert [r.name for r in reg.unscoped()] == ["clash"]
    with AdapterRegistry(db_path) as unscoped:  # the view of no model: what nobody claimed yet
        assert [r.name for r in unscoped.list()] == ["clash"] and unscoped.claim("clash") is None


def test_identity_and_use_counts_are_recorded(reg: AdapterRegistry) -> None:
    reg.add("a", "/a", content_hash="ab" * 32, fingerprint="adapter_config.json:10:5")
    reg.record_identity("a", "cd" * 32, "adapter_config.json:11:6")
    reg.record_identity("missing", "ef" * 32, "")  # a name not registered here: nothing happens
    reg.add_uses({"a": 3, "missing": 4})
    reg.add_uses({"a": 2})
    rec = reg.get("a")
    assert (rec.content_hash, rec.fingerprint, rec.uses) == ("cd" * 32, "adapter_config.json:11:6", 5)
    assert reg.add("a", "/b", replace=True).uses == 5  # a new path keeps the history


def test_model_scope_follows_the_architecture_not_the_path(tmp_path: Path, monkeypatch) -> None:
    import json

    from loraplex.daemon.model_scope import ModelScopeError, model_scope

    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024, "rope_theta": 1e4}
    for name, cfg in (("a", config), ("moved", {**config, "rope_theta": 5e5, "torch_dtype": "bfloat16"}),
                      ("wider", {**config, "hidden_size": 512})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    assert model_scope(tmp_path / "a") == model_scope(tmp_path / "moved")  # fit-irrelevant fields differ
    assert model_scope(tmp_path / "a") != model_scope(tmp_path / "wider")
    assert model_scope(tmp_path / "a").startswith("llama-")
    monkeypatch.setenv("LORAPLEX_DEMO", "random")
    assert model_scope(None) == "demo-random"
    with pytest.raises(ModelScopeError, match="no config.json"):
        model_scope(tmp_path)


def test_a_replace_without_identity_keeps_the_recorded_one_for_the_same_path(reg: AdapterRegistry) -> None:
    reg.add("a", "/a", content_hash="ab" * 32, fingerprint="adapter_config.json:10:5")
    assert reg.add("a", "/a", replace=True, source="flag").content_hash == "ab" * 32  # every start's --adapter
    moved = reg.add("a", "/elsewhere", replace=True, source="flag")
    assert (moved.content_hash, moved.fingerprint) == ("", "")  # other files: read them again
