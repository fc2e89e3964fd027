"""Daemon configuration: defaults < TOML file < environment < flags, strict parsing
(typos and wrong types fail, naming the key and where it came from), and the
example file reading back to the defaults."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from loraplex.contracts.settings import convert
from loraplex.daemon.config import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ConfigError,
    LoraplexConfig,
    ModelSettings,
    SchedulerSettings,
    ServerSettings,
)
from loraplex.daemon.config_load import load_config
from loraplex.daemon.config_names import default_state_dir, env_var, parse_adapter_arg
from loraplex.daemon.config_toml import config_to_dict, example_toml, render_toml


def write(tmp_path: Path, text: str, name: str = "loraplex.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_any_source() -> None:
    cfg = load_config(None, env={})
    assert cfg == LoraplexConfig()
    assert cfg.model.model is None and cfg.model.uses_demo_model
    assert cfg.scheduler.max_num_seqs == 64 and cfg.scheduler.policy == "fcfs"
    assert cfg.server.max_message_bytes == 8 << 20
    assert cfg.adapters == ()


def test_message_limit_default_matches_ipc_codec() -> None:
    from loraplex.ipc.codec import DEFAULT_MAX_MESSAGE_BYTES as IPC_DEFAULT

    assert DEFAULT_MAX_MESSAGE_BYTES == IPC_DEFAULT


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, """
[scheduler]
max_num_seqs = 8
max_batched_tokens = 512
max_loras_per_batch = 4
[model]
dtype = "float16"
""")
    cfg = load_config(path, env={})
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_batched_tokens,
            cfg.scheduler.max_loras_per_batch) == (8, 512, 4)
    env = {"LORAPLEX_SCHEDULER_MAX_NUM_SEQS": "16", "LORAPLEX_SCHEDULER_MAX_LORAS_PER_BATCH": "6"}
    cfg = load_config(path, env=env)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_batched_tokens,
            cfg.scheduler.max_loras_per_batch) == (16, 512, 6)
    cfg = load_config(path, env=env, overrides={"scheduler.max_num_seqs": 32, "model.dtype": None})
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_loras_per_batch) == (32, 6)
    assert cfg.model.dtype == "float16"  # None = flag not given: the file's value stays


def test_config_file_from_env_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "[model]\ndevice = \"cpu\"\n")
    assert load_config(None, env={"LORAPLEX_CONFIG": str(path)}).model.device == "cpu"


def test_env_aliases_and_conflicts(tmp_path: Path) -> None:
    cfg = load_config(None, env={"LORAPLEX_MODEL": "/m", "LORAPLEX_RUNTIME_DIR": "/r", "LORAPLEX_STATE_DIR": "/s"})
    assert (cfg.model.model, cfg.server.runtime_dir, cfg.server.state_dir) == ("/m", "/r", "/s")
    assert load_config(None, env={"LORAPLEX_MODEL": "/m", "LORAPLEX_MODEL_MODEL": "/m"}).model.model == "/m"
    with pytest.raises(ConfigError, match="LORAPLEX_MODEL.*LORAPLEX_MODEL_MODEL.*model.model"):
        load_config(None, env={"LORAPLEX_MODEL": "/a", "LORAPLEX_MODEL_MODEL": "/b"})


def test_other_components_variables_are_ignored() -> None:
    env = {"LORAPLEX_CACHE_DIR": "/c", "LORAPLEX_WHATEVER": "x", "PATH": "/bin"}
    assert load_config(None, env=env) == LoraplexConfig()


@pytest.mark.parametrize(
    ("var", "text", "section", "field", "expected"),
    [
        ("LORAPLEX_MODEL_MAX_LORA_RANK", " 64 ", "model", "max_lora_rank", 64),
        ("LORAPLEX_MODEL_POOL_BYTES", "1_000_000", "model", "pool_bytes", 1_000_000),
        ("LORAPLEX_MODEL_GPU_MEMORY_UTILIZATION", "0.5", "model", "gpu_memory_utilization", 0.5),
        ("LORAPLEX_MODEL_GPU_MEMORY_UTILIZATION", "1", "model", "gpu_memory_utilization", 1.0),
        ("LORAPLEX_MODEL_DEVICE", "cuda:1", "model", "device", "cuda:1"),
        ("LORAPLEX_MODEL_MAX_MODEL_LEN", "none", "model", "max_model_len", None),
        ("LORAPLEX_MODEL_MAX_MODEL_LEN", "", "model", "max_model_len", None),
        ("LORAPLEX_MODEL_MAX_MODEL_LEN", "2048", "model", "max_model_len", 2048),
        ("LORAPLEX_MODEL_MODEL", "None", "model", "model", None),
        ("LORAPLEX_SERVER_TCP_LISTEN", "tcp://127.0.0.1:5555", "server", "tcp_listen", "tcp://127.0.0.1:5555"),
        ("LORAPLEX_SERVER_TCP_LISTEN", "tcp://[::1]:80", "server", "tcp_listen", "tcp://[::1]:80"),
        ("LORAPLEX_SERVER_ADAPTER_DIRS", "/a, /b,", "server", "adapter_dirs", ("/a", "/b")),
        ("LORAPLEX_SERVER_ADAPTER_DIRS", "", "server", "adapter_dirs", ()),
        ("LORAPLEX_SERVER_DRAIN_TIMEOUT_S", "0", "server", "drain_timeout_s", 0.0),
    ],
)
def test_env_values_parse_by_field_type(var: str, text: str, section: str, field: str, expected: object) -> None:
    value = getattr(getattr(load_config(None, env={var: text}), section), field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("true", True), ("YES", True), ("on", True),
     ("0", False), ("false", False), ("No", False), ("off", False)],
)
def test_bool_text_parsing(text: str, expected: bool) -> None:
    assert convert("x.flag", text, bool, where="test", from_text=True) is expected


def test_bool_text_parsing_rejects_other_words() -> None:
    with pytest.raises(ConfigError, match=r"x\.flag: expected a boolean.*'maybe' \(from test\)"):
        convert("x.flag", "maybe", bool, where="test", from_text=True)
    with pytest.raises(ConfigError, match="expected a boolean"):
        convert("x.flag", 1, bool, where="file f", from_text=False)  # TOML 1 is not a boolean


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"LORAPLEX_SCHEDULER_MAX_NUM_SEQS": "eight"},
         r"scheduler\.max_num_seqs: expected an integer.*LORAPLEX_SCHEDULER_MAX_NUM_SEQS"),
        ({"LORAPLEX_SCHEDULER_MAX_NUM_SEQS": "8.0"}, r"expected an integer"),
        ({"LORAPLEX_MODEL_GPU_MEMORY_UTILIZATION": "most"}, r"gpu_memory_utilization: expected a number"),
        ({"LORAPLEX_SCHEDULER_MAX_NUM_SEQS": "0"},
         r"max_num_seqs must be positive.*environment variable LORAPLEX_SCHEDULER_MAX_NUM_SEQS"),
        ({"LORAPLEX_MODEL_GPU_MEMORY_UTILIZATION": "1.5"}, r"gpu_memory_utilization must be .*<= 1.0"),
        ({"LORAPLEX_MODEL_GPU_MEMORY_UTILIZATION": "nan"}, r"gpu_memory_utilization must be a finite number"),
        ({"LORAPLEX_SERVER_DRAIN_TIMEOUT_S": "inf"}, r"drain_timeout_s must be a finite number"),
        ({"LORAPLEX_MODEL_DEVICE": "gpu"}, r"model\.device must be auto, cpu, cuda or cuda:N"),
        ({"LORAPLEX_MODEL_DTYPE": "fp8"}, r"model\.dtype must be one of auto, float32, bfloat16, float16"),
        ({"LORAPLEX_MODEL_LORA_BACKEND": "cutlass"}, r"lora_backend must be one of"),
        ({"LORAPLEX_SCHEDULER_POLICY": "fcsf"}, r"scheduler\.policy must be one of fcfs"),
        ({"LORAPLEX_SERVER_TCP_LISTEN": "http://x:1"}, r"tcp_listen must look like tcp://HOST:PORT"),
        ({"LORAPLEX_SERVER_TCP_LISTEN": "tcp://x:70000"}, r"tcp_listen"),
        ({"LORAPLEX_SERVER_TCP_LISTEN": "tcp://x"}, r"tcp_listen"),
        ({"LORAPLEX_SERVER_MAX_MESSAGE_BYTES": "100"}, r"max_message_bytes must be >= 4096"),
        ({"LORAPLEX_SERVER_STATS_INTERVAL_S": "0"}, r"stats_interval_s must be a finite number > 0"),
        ({"LORAPLEX_MODEL_NUM_PAGES": "10", "LORAPLEX_MODEL_POOL_BYTES": "10"}, r"set at most one"),
        ({"LORAPLEX_SCHEDULER_MAX_BATCHED_TOKENS": "8"},
         r"max_batched_tokens \(8\) must be >= scheduler\.max_num_seqs \(64\)"),
        ({"LORAPLEX_MODEL_MAX_MODEL_LEN": "-1"}, r"max_model_len must be positive"),
    ],
)
def test_invalid_env_values_name_the_key(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, env=env)


def test_unknown_env_key_is_rejected_with_valid_names() -> None:
    with pytest.raises(ConfigError, match=r"LORAPLEX_SCHEDULER_MAX_NUM_SEQ\b.*LORAPLEX_SCHEDULER_MAX_NUM_SEQS") as err:
        load_config(None, env={"LORAPLEX_SCHEDULER_MAX_NUM_SEQ": "8"})
    assert isinstance(err.value, ValueError)
    with pytest.raises(ConfigError, match="LORAPLEX_MODEL_DIR"):
        load_config(None, env={"LORAPLEX_MODEL_DIR": "/m"})


def test_unknown_file_keys_and_sections_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError,
                       match=r"scheduler\.max_num_seq .*valid \[scheduler\] settings: policy, max_num_seqs"):
        load_config(write(tmp_path, "[scheduler]\nmax_num_seq = 8\n"), env={})
    with pytest.raises(ConfigError, match=r"unknown section \[schedular\].*model, scheduler, server, adapters"):
        load_config(write(tmp_path, "[schedular]\nmax_num_seqs = 8\n"), env={})
    with pytest.raises(ConfigError, match=r"model must be a table"):
        load_config(write(tmp_path, "model = \"/m\"\n"), env={})


def test_file_values_are_type_checked_strictly(tmp_path: Path) -> None:
    path = write(tmp_path, "[scheduler]\nmax_num_seqs = \"8\"\n")
    with pytest.raises(ConfigError,
                       match=rf"scheduler\.max_num_seqs: expected an integer, got '8' \(from file {path}\)"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(write(tmp_path, "[scheduler]\nmax_num_seqs = true\n"), env={})
    with pytest.raises(ConfigError, match="adapter_dirs: expected a list of strings"):
        load_config(write(tmp_path, "[server]\nadapter_dirs = \"/a\"\n"), env={})
    with pytest.raises(ConfigError, match=r"max_num_seqs must be positive.*from file"):
        load_config(write(tmp_path, "[scheduler]\nmax_num_seqs = 0\n"), env={})
    # an int where a float is expected is widened
    cfg = load_config(write(tmp_path, "[server]\ndrain_timeout_s = 5\n"), env={})
    assert cfg.server.drain_timeout_s == 5.0 and isinstance(cfg.server.drain_timeout_s, float)


def test_bad_files_raise_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"), env={})


def test_overrides_accept_typed_and_text_values() -> None:
    cfg = load_config(None, env={}, overrides={
        "scheduler.max_num_seqs": "12",
        "model.max_model_len": "none",
        "model.gpu_memory_utilization": 0.5,
        "server.adapter_dirs": ["/x", "/y"],
    })
    assert cfg.scheduler.max_num_seqs == 12 and cfg.model.max_model_len is None
    assert cfg.model.gpu_memory_utilization == 0.5 and cfg.server.adapter_dirs == ("/x", "/y")
    with pytest.raises(ConfigError, match=r"unknown setting 'scheduler\.max_seqs'"):
        load_config(None, env={}, overrides={"scheduler.max_seqs": 1})
    with pytest.raises(ConfigError,
                       match=r"max_num_seqs: expected an integer, got 1.5 \(from flag scheduler\.max_num_seqs\)"):
        load_config(None, env={}, overrides={"scheduler.max_num_seqs": 1.5})


def test_adapter_flags_and_table_merge_by_name(tmp_path: Path) -> None:
    (tmp_path / "rel").mkdir()
    path = write(tmp_path, '[adapters]\nqv-r8 = "/srv/qv"\n"sql.v2" = "rel"\n')
    cfg = load_config(path, env={})
    assert cfg.adapters == (("qv-r8", "/srv/qv"), ("sql.v2", str(tmp_path.resolve() / "rel")))
    cfg = load_config(path, env={}, overrides={"adapters": ["qv-r8=/other", "new=/n"]})
    assert dict(cfg.adapters) == {"qv-r8": "/other", "sql.v2": str(tmp_path.resolve() / "rel"), "new": "/n"}
    assert load_config(None, env={}, overrides={"adapters": {"a": "/a"}}).adapters == (("a", "/a"),)
    assert load_config(None, env={}, overrides={"adapters": [("a", "/a")]}).adapters == (("a", "/a"),)
    assert parse_adapter_arg("x = /p=q") == ("x", "/p=q")
    for bad in ("noequals", "=/p", "name="):
        with pytest.raises(ValueError, match="NAME=DIR"):
            parse_adapter_arg(bad)
    with pytest.raises(ConfigError, match=r"name 'bad name'.*\(from flag adapters\)"):
        load_config(None, env={}, overrides={"adapters": ["bad name=/p"]})
    with pytest.raises(ConfigError, match="must map to a directory string"):
        load_config(write(tmp_path, "[adapters]\nx = 3\n"), env={})


def test_relative_paths_are_anchored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    path = write(sub, '[server]\nstate_dir = "state"\nadapter_dirs = ["ad", "/abs"]\n')
    cfg = load_config(path, env={})
    assert cfg.server.state_dir == str(sub.resolve() / "state")
    assert cfg.server.adapter_dirs == (str(sub.resolve() / "ad"), "/abs")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, env={"LORAPLEX_RUNTIME_DIR": "run"}, overrides={"adapters": ["a=ad/a"]})
    assert cfg.server.runtime_dir == str(tmp_path / "run")
    assert cfg.adapters == (("a", str(tmp_path / "ad" / "a")),)
    home = Path.home()
    assert load_config(None, env={"LORAPLEX_STATE_DIR": "~/st"}).server.state_dir == str(home / "st")


def test_example_toml_round_trips_to_defaults(tmp_path: Path) -> None:
    text = example_toml()
    tomllib.loads(text)  # valid TOML
    assert load_config(write(tmp_path, text), env={}) == LoraplexConfig()
    # every field is documented in the example, set or commented out
    for section in ("model", "scheduler", "server"):
        for field in config_to_dict(LoraplexConfig())[section]:  # type: ignore[union-attr]
            assert f"{field} = " in text and env_var(f"{section}.{field}") in text


def test_render_toml_round_trips_a_non_default_config(tmp_path: Path) -> None:
    cfg = LoraplexConfig(
        model=ModelSettings(model="/m/\"quoted\"\tx", device="cuda:0", max_model_len=4096, pool_bytes=1 << 33),
        scheduler=SchedulerSettings(max_num_seqs=8, max_batched_tokens=8),
        server=ServerSettings(state_dir="/s", tcp_listen="tcp://*:5555", tcp_insecure=True, adapter_dirs=("/a", "/b"),
                              stats_interval_s=1e-3),
        adapters=(("qv.r8", "/x"), ("b", "/y")),
    )
    assert load_config(write(tmp_path, render_toml(cfg)), env={}) == cfg
    assert load_config(write(tmp_path, render_toml(cfg, comments=False)), env={}) == cfg


def test_config_to_dict_is_plain() -> None:
    cfg = LoraplexConfig(server=ServerSettings(adapter_dirs=("/a",)), adapters=(("x", "/x"),))
    d = config_to_dict(cfg)
    assert d["server"]["adapter_dirs"] == ["/a"]  # type: ignore[index]
    assert d["adapters"] == {"x": "/x"}
    assert d["scheduler"] == {"policy": "fcfs", "max_num_seqs": 64, "max_batched_tokens": 2048,
                              "max_loras_per_batch": 64,
                              "ttft_slo_ms": None, "cluster_adapters": False, "cache_policy": "lru",
                              "cache_predictor": False, "cache_predictor_horizon_s": 5.0, "prefix_cache": True,
                              "admit_when_loaded": True, "overlap": True,
                              "router": "most_idle", "router_profile": None, "router_kernel": "mbgmv",
                              "tpt_slo_ms": 36.0, "rebalance_interval_s": 0.2}


def test_multi_engine_settings_are_validated() -> None:
    assert LoraplexConfig(server=ServerSettings(engines=3)).server.engines == 3
    with pytest.raises(ConfigError, match="server.engines must be positive"):
        ServerSettings(engines=0)
    with pytest.raises(ConfigError, match="scheduler.router must be one of"):
        SchedulerSettings(router="round_robin")
    with pytest.raises(ConfigError, match="cpu_assist runs one engine"):
        LoraplexConfig(model=ModelSettings(adapter_load_mode="cpu_assist"), server=ServerSettings(engines=2))
    cfg = load_config(None, env={"LORAPLEX_SERVER_ENGINES": "2"}, overrides={"scheduler.router": "dlora"})
    assert (cfg.server.engines, cfg.scheduler.router) == (2, "dlora")


def test_direct_construction_validates() -> None:
    with pytest.raises(ValueError, match="max_lora_rank: expected an integer"):
        ModelSettings(max_lora_rank="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be an absolute path"):
        LoraplexConfig(adapters=(("a", "rel"),))
    with pytest.raises(ValueError, match="given twice"):
        LoraplexConfig(adapters=(("a", "/x"), ("a", "/y")))
    with pytest.raises(ValueError, match="pair of strings"):
        LoraplexConfig(adapters=("ab",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a ModelSettings"):
        LoraplexConfig(model=SchedulerSettings())  # type: ignore[arg-type]
    assert ServerSettings(adapter_dirs=["/a"]).adapter_dirs == ("/a",)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        ServerSettings().drain_timeout_s = 1.0  # type: ignore[misc]


def test_derived_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_state_dir({"LORAPLEX_STATE_DIR": "/s"}) == Path("/s")
    assert default_state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/loraplex")
    assert default_state_dir({}) == Path.home() / ".local" / "state" / "loraplex"
    server = ServerSettings(state_dir=str(tmp_path), runtime_dir=str(tmp_path / "run"))
    assert server.resolved_state_dir == tmp_path and server.registry_path == tmp_path / "registry.sqlite3"
    assert server.resolved_runtime_dir == tmp_path / "run"
    monkeypatch.setenv("LORAPLEX_RUNTIME_DIR", str(tmp_path / "envrun"))
    monkeypatch.setenv("LORAPLEX_STATE_DIR", str(tmp_path / "envstate"))
    assert ServerSettings().resolved_runtime_dir == tmp_path / "envrun"
    assert ServerSettings().resolved_state_dir == tmp_path / "envstate"


def test_load_config_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_SCHEDULER_MAX_LORAS_PER_BATCH", "3")
    assert load_config(None).scheduler.max_loras_per_batch == 3


def test_config_modules_import_no_torch_numpy_or_zmq() -> None:
    code = (
        "import sys, loraplex.daemon.config, loraplex.daemon.registry, loraplex.daemon.detokenizer\n"
        "bad = [m for m in ('torch', 'numpy', 'zmq') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONWARNINGS": "error"})


def test_the_engine_spec_is_built_once_from_the_settings_and_travels_typed() -> None:
    """Every [model] engine setting, the largest batch and the adapter directories reach the
    children as one typed spec; JSON (the child's command line) carries it back unchanged."""
    from loraplex.contracts.engine_spec import EngineSpec
    from loraplex.daemon.config import ENGINE_SETTINGS

    assert set(ENGINE_SETTINGS) | {"load_groups"} == {f for f in config_to_dict(LoraplexConfig())["model"]}
    cfg = load_config(None, env={}, overrides={"model.dtype": "bfloat16", "model.num_pages": 333,
                                               "model.load_throttle_bytes_s": 4e6, "scheduler.max_num_seqs": 9,
                                               "server.adapter_dirs": "/srv/a,/srv/b", "model.cuda_graphs": False})
    spec = cfg.engine_spec("inst")
    assert (spec.dtype, spec.num_pages, spec.load_throttle_bytes_s, spec.cuda_graphs) == ("bfloat16", 333, 4e6, False)
    assert (spec.max_num_seqs, spec.adapter_dirs, spec.shm_instance) == (9, ("/srv/a", "/srv/b"), "inst")
    assert all(getattr(spec, name) == getattr(cfg.model, name) for name in ENGINE_SETTINGS)
    assert EngineSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError, match="unknown engine spec fields: load_groups"):
        EngineSpec.from_json('{"load_groups": 4}')
    with pytest.raises(ConfigError, match="max_lora_rank: expected an integer"):
        EngineSpec.from_json('{"max_lora_rank": "8"}')
    with pytest.raises(ConfigError, match="dtype must be one of auto"):
        EngineSpec(dtype="fp8")


def test_every_default_is_defined_once() -> None:
    """The [model] section's engine settings default to the engine spec's, the [scheduler] limits to
    the scheduler's own (max_loras_per_batch 64, admit_when_loaded on), and the largest batch is
    one number everywhere."""
    from loraplex.contracts.engine_spec import DEFAULT_MAX_NUM_SEQS, EngineSpec
    from loraplex.daemon.config import ENGINE_SETTINGS
    from loraplex.daemon.router.state import EngineState
    from loraplex.daemon.scheduler.config import SchedulerConfig
    from loraplex.daemon.sim.profile import SimProfile

    model, engine = ModelSettings(), EngineSpec()
    assert {n: getattr(model, n) for n in ENGINE_SETTINGS} == {n: getattr(engine, n) for n in ENGINE_SETTINGS}
    sched, policy = SchedulerSettings(), SchedulerConfig()
    for name in ("max_num_seqs", "max_batched_tokens", "max_loras_per_batch", "admit_when_loaded", "cache_policy",
                 "cluster_adapters"):
        assert getattr(sched, name) == getattr(policy, name), name
    assert (policy.max_loras_per_batch, policy.admit_when_loaded) == (64, True)
    assert {sched.max_num_seqs, engine.max_num_seqs, SimProfile().max_num_seqs,
            EngineState(engine_id=0).max_num_seqs} == {DEFAULT_MAX_NUM_SEQS}
