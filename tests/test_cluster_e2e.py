"""`loraplex cluster serve` end to end: a local Ray cluster on loopback (no dashboard) with two
replicas on the CPU demo model, started once for the module as a subprocess, driven with the
official `openai` client and plain HTTP: greedy text equals a single daemon's, /metrics carries
the vLLM families Kubernetes routers read, requests for one adapter stay on the replica that
holds it, a killed replica daemon fails its requests loudly (none hangs or ends silently) and
is replaced, every process of the cluster listens on loopback only (and no dashboard runs), and
SIGTERM tears everything down with exit 0 and no process left behind.
"""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from loraplex.contracts.host import free_loopback_port  # noqa: E402
from loraplex.gateway.chat_template import ChatTemplate  # noqa: E402
from tests.daemon_process import DaemonProcess  # noqa: E402

DAEMON_ARGS = ("--num-pages", "600", "--max-num-seqs", "16")
ADAPTERS = ("all-r32", "mlp-r64", "qv-r8")  # the test demo model (LORAPLEX_DEMO=random, conftest)
BASE = "loraplex-base"
START_TIMEOUT_S = 150.0



def _descendants(root: int) -> set[int]:
    """Every live process below `root` (by parent pid, from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Cluster:
    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "cluster.log"
        argv = [sys.executable, "-m", "loraplex.cli", "cluster", "serve", "--replicas", "2", "--http-port",
                str(self.port), *(f"--daemon-arg={a}" for a in DAEMON_ARGS), "--log-level", "warning", *args]
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})})
        self.pids: set[int] = set()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the cluster exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if len(self.replicas()) == 2:
                    self.pids = _descendants(self.proc.pid)
                    return
            except OSError:
                pass
            time.sleep(0.5)  # Serve offers no readiness event to a foreign process
        raise TimeoutError(f"the cluster did not come up:\n{self.log()}")

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def replicas(self) -> list[dict]:
        status, body = self.get("/v1/cluster/replicas")
        return json.loads(body)["data"] if status == 200 else []

    def stop(self) -> int:
        self.pids |= _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                for pid in _descendants(self.proc.pid):
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


class S3:
    """moto's standalone S3-compatible server on a loopback port, with one bucket."""

    BUCKET = "loraplex-adapters"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_loopback_port()
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1")
        self.client.create_bucket(Bucket=self.BUCKET)

    def upload(self, name: str, adapter_dir: Path) -> None:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            self.client.upload_file(str(adapter_dir / f), self.BUCKET, f"adapters/{name}/{f}")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    pytest.importorskip("moto.server")
    store = S3()
    try:
        yield store
    finally:
        store.server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, s3: S3) -> Iterator[Cluster]:
    # A TPT SLO no CPU step misses: placement here is adapter affinity alone, whatever the host's
    # load does to step times (the SLO term is covered by tests/test_cluster_units.py).
    c = Cluster(tmp_path_factory.mktemp("cluster"), "--adapter-source", f"s3://{S3.BUCKET}/adapters",
                "--router-slo-ms", "100000", "--enable-adapter-admin", env=s3.env)
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster):
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_greedy_outputs_equal_a_single_daemon(cluster: Cluster, client, tmp_path: Path) -> None:
    prompt = "ROMEO:"
    messages = [{"role": "user", "content": "Speak, fair one"}]
    through = {}
    for model in (BASE, *ADAPTERS):
        done = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0.0,
                                                stream=True, extra_body={"ignore_eos": True})
        through[model] = (done.choices[0].text, "".join(c.choices[0].delta.content or "" for c in stream
                                                        if c.choices))
    chat_prompt = ChatTemplate.from_model_dir(None).render(messages, add_generation_prompt=True)
    daemon = DaemonProcess(tmp_path, *DAEMON_ARGS).start()
    try:
        with daemon.client() as c:
            for model in (BASE, *ADAPTERS):
                adapter = None if model == BASE else model
                alone = (c.generate(prompt, adapter, max_tokens=12, temperature=0.0, ignore_eos=True).text,
                         c.generate(chat_prompt, adapter, max_tokens=10, temperature=0.0, ignore_eos=True).text)
                assert through[model] == alone, model
    finally:
        assert daemon.stop() == 0
    assert len({texts[0] for texts in through.values()}) == len(through)  # the adapters really differ


def _greedy(client, model: str) -> str:
    return client.completions.create(model=model, prompt="KING:", max_tokens=10, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def _adapter_dirs(client) -> dict[str, Path]:
    return {m.id: Path(m.root) for m in client.models.list().data if m.parent is not None}


def test_an_s3_adapter_is_served_and_never_stale(cluster: Cluster, client, s3: S3) -> None:
    dirs = _adapter_dirs(client)
    s3.upload("from-s3", dirs["all-r32"])
    first = [_greedy(client, "from-s3") for _ in range(2)]
    assert first == [_greedy(client, "all-r32")] * 2
    s3.upload("from-s3", dirs["mlp-r64"])  # replaced in the store: the very next request sees it
    assert _greedy(client, "mlp-r64") != first[0]
    assert [_greedy(client, "from-s3") for _ in range(3)] == [_greedy(client, "mlp-r64")] * 3
    with pytest.raises(openai.NotFoundError):
        _greedy(client, "not-in-s3")


def test_register_and_remove_at_the_ingress_apply_to_the_cluster(cluster: Cluster, client) -> None:
    dirs = _adapter_dirs(client)
    loaded = client.post("/load_lora_adapter", cast_to=str,
                         body={"lora_name": "registered", "lora_path": str(dirs["qv-r8"])})
    assert "registered" in loaded
    assert "registered" in {m.id for m in client.models.list().data}
    assert _greedy(client, "registered") == _greedy(client, "qv-r8")
    client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "registered"})
    with pytest.raises(openai.NotFoundError):
        _greedy(client, "registered")
    assert "registered" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "registered"})


def test_metrics_for_kubernetes_routers(cluster: Cluster) -> None:
    status, body = cluster.get("/metrics")
    text = body.decode()
    assert status == 200
    for family in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                   "vllm:lora_requests_info{"):
        assert family in text, family
    assert 'max_lora="' in text and "running_lora_adapters=" in text and "waiting_lora_adapters=" in text
    for row in cluster.replicas():
        status, body = cluster.get(row["metrics"])
        assert status == 200 and "vllm:lora_requests_info{" in body.decode()
        assert "vllm:num_requests_running" in body.decode()
    assert cluster.get("/metrics/replicas/nope")[0] == 404


def _served(cluster: Cluster, adapter: str) -> dict[str, int]:
    return {r["replica"]: int(r["requests_by_adapter"].get(adapter, 0)) for r in cluster.replicas()}


def _wait_served(cluster: Cluster, adapter: str, total: int) -> dict[str, int]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        counts = _served(cluster, adapter)
        if sum(counts.values()) >= total:
            return counts
        time.sleep(0.3)  # the board hears each replica once per stats period
    raise AssertionError(f"the replicas reported {counts} requests for {adapter}, expected {total}")


def test_requests_for_one_adapter_go_to_the_replica_holding_it(cluster: Cluster, client) -> None:
    adapter = "attn-r16"
    before = _served(cluster, adapter)
    n = 6
    for i in range(n):
        client.completions.create(model=adapter, prompt=f"line {i}:", max_tokens=4, temperature=0.0)
    after = _wait_served(cluster, adapter, sum(before.values()) + n)
    delta = {r: after[r] - before.get(r, 0) for r in after}
    assert sorted(delta.values()) == [0, n], delta


def _stream_outcome(cluster: Cluster, model: str, max_tokens: int) -> str:
    """'done' (a finish reason arrived), 'error' (an error event or status) or 'silent' (neither)."""
    body = json.dumps({"model": model, "prompt": "KING:", "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(cluster.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as exc:
        return "error" if b'"error"' in exc.read() else "silent"
    if '"error"' in text:
        return "error"
    return "done" if '"finish_reason":"length"' in text and text.rstrip().endswith("[DONE]") else "silent"


def test_a_killed_replica_daemon_loses_no_request_silently(cluster: Cluster, client) -> None:
    adapter = "kdown-r8"
    before = _served(cluster, adapter)
    client.completions.create(model=adapter, prompt="x", max_tokens=2, temperature=0.0)
    after = _wait_served(cluster, adapter, sum(before.values()) + 1)
    holder = next(r for r in after if after[r] > before.get(r, 0))
    pid = next(r["daemon_pid"] for r in cluster.replicas() if r["replica"] == holder)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream_outcome, cluster, adapter, 400) for _ in range(3)]
        time.sleep(1.0)  # let the streams begin on the holder before its daemon dies
        os.kill(pid, signal.SIGKILL)
        later = [pool.submit(_stream_outcome, cluster, m, 8) for m in (adapter, BASE, "all-r32")]
        outcomes = [f.result(timeout=90) for f in streams + later]
    assert "silent" not in outcomes, outcomes
    _wait_replaced(cluster, pid)  # Serve replaces the replica whose daemon died
    assert [_stream_outcome(cluster, m, 6) for m in (adapter, BASE)] == ["done", "done"]


def _wait_replaced(cluster: Cluster, gone_pid: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        rows = cluster.replicas()
        if len(rows) == 2 and all(r["daemon_pid"] != gone_pid for r in rows):
            return
        time.sleep(0.5)  # Serve's health check and the new replica's daemon start; no event to await
    raise AssertionError(f"the replica was not replaced: {cluster.replicas()}\n{cluster.log()}")


def test_a_killed_replica_process_takes_its_daemon_and_no_request_silently(cluster: Cluster, client) -> None:
    adapter = "rslora-r16"
    before = _served(cluster, adapter)
    client.completions.create(model=adapter, prompt="x", max_tokens=2, temperature=0.0)
    after = _wait_served(cluster, adapter, sum(before.values()) + 1)
    holder = next(r for r in after if after[r] > before.get(r, 0))
    daemon_pid = next(r["daemon_pid"] for r in cluster.replicas() if r["replica"] == holder)
    replica_pid = int(Path(f"/proc/{daemon_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream_outcome, cluster, adapter, 400) for _ in range(2)]
        time.sleep(1.0)  # let the streams begin on the holder before its process dies
        os.kill(replica_pid, signal.SIGKILL)
        later = [pool.submit(_stream_outcome, cluster, m, 8) for m in (adapter, BASE)]
        outcomes = [f.result(timeout=90) for f in streams + later]
    assert "silent" not in outcomes, outcomes
    deadline = time.monotonic() + 15
    while _alive(daemon_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(daemon_pid), "the dead replica's daemon was left running"
    _wait_replaced(cluster, daemon_pid)
    assert [_stream_outcome(cluster, m, 6) for m in (adapter, BASE)] == ["done", "done"]


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (a dual-stack socket)
    return (mapped or address).is_loopback


def _kind(argv: list[str]) -> str:
    """gcs_server, raylet, ray::ProxyActor (a worker's title, less its current method), or the
    script or module a Python process runs (monitor.py, dashboard.py, loraplex.cli, ...)."""
    if not argv:
        return ""
    name = Path(argv[0]).name
    if not name.startswith("python"):
        return name.split(".", 1)[0] if name.startswith("ray::") else name
    rest = [a for a in argv[1:] if not a.startswith("-") or a == "-m"]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return rest[1]
    return Path(rest[0]).name if rest else name


def test_the_local_ray_cluster_listens_on_loopback_only(cluster: Cluster) -> None:
    """Every process of the local cluster (GCS, raylet, its agents, the autoscaler monitor, each
    worker: Serve's controller, proxy and replicas, and the daemons below them) listens on
    loopback only, and no Ray dashboard runs."""
    psutil = pytest.importorskip("psutil")
    seen, exposed, dashboards = set(), [], []
    for pid in sorted(_descendants(cluster.proc.pid) | {cluster.proc.pid}):
        try:
            proc = psutil.Process(pid)
            argv = proc.cmdline()
            sockets = proc.net_connections(kind="inet")
        except psutil.Error:
            continue  # gone meanwhile (a worker Ray let go)
        kind = _kind(argv) or proc.name()
        seen.add(kind)
        name = f"{kind} (pid {pid})"
        if any(a.endswith(os.path.join("dashboard", "dashboard.py")) for a in argv):
            dashboards.append(name)
        for s in sockets:  # a TCP listener, or a UDP socket bound without a peer
            if (s.status == psutil.CONN_LISTEN or (s.type == socket.SOCK_DGRAM and not s.raddr)) \
                    and not _is_loopback(s.laddr.ip):
                exposed.append(f"{name}: {s.laddr.ip}:{s.laddr.port}")
    assert {"gcs_server", "raylet", "ray::ServeController", "ray::ProxyActor",
            "ray::ServeReplica:loraplex:LoraplexReplica"} <= seen, sorted(seen)
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert not dashboards, f"a Ray dashboard runs: {dashboards}"


def test_sigterm_tears_everything_down(cluster: Cluster) -> None:
    pids = cluster.pids | _descendants(cluster.proc.pid)
    assert pids, "the cluster started no processes?"
    assert cluster.stop() == 0, cluster.log()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    assert not left, f"processes left behind: {left}"
