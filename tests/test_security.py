"""Security defaults (docs/security.md), each pinned by a test that fails when the default is lost.

1. Every listener a run opens binds to loopback: a real short run (fsdp trainer
   at world size 2, ``dist`` weight transport, ``multiprocess`` and
   ``distributed`` stores) is watched from outside through /proc while it runs.
2. The multiprocess store's control channel accepts only its own processes:
   tests/store_deployments/test_multiprocess.py::test_channel_is_private_and_refuses_a_wrong_token
   (0700 directory, 0600 socket, wrong token and garbage handshakes refused);
   here, the shared-memory arena beside it.
3. Nothing unpickles bytes from a socket: an AST scan of the source tree with
   an explicit allow-list.
4. Ray's token authentication is never switched off by the project.
5. Secrets never land in a run directory or a log line.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.config.redact import (
    REDACTED,
    Redactor,
    install_log_redaction,
    is_secret_key,
    redact_config,
    redacted_paths,
    secret_values,
)

ROOT = Path(__file__).resolve().parents[1]
ARITHMETIC = ROOT / "examples" / "arithmetic_grpo.yaml"
TOY = ROOT / "examples" / "toy_grpo.yaml"
SOURCE_DIRS = ("asyncflow_core", "asyncflow_plugins", "adapters", "spec")


def _python_files(dirs=SOURCE_DIRS) -> list[Path]:
    out = []
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = path.relative_to(ROOT).parts
            if "tests" in rel or any(p.startswith(".") for p in rel) or "build" in rel:
                continue
            out.append(path)
    return out


# ============================================================ 1. listeners bind to loopback


def _process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    pids, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in pids:
            pids.add(pid)
            todo.extend(children.get(pid, []))
    return pids


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _proc_ip(hex_ip: str) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    addr = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(addr.ipv4_mapped or addr)


def _tcp_listeners() -> dict[int, tuple[str, int]]:
    """Socket inode -> (ip, port) of every TCP socket in LISTEN state on the host."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A":  # TCP_LISTEN
                ip_hex, port_hex = parts[1].split(":")
                out[int(parts[9])] = (_proc_ip(ip_hex), int(port_hex, 16))
    return out


def _unix_listeners() -> dict[int, str]:
    """Socket inode -> path ('@...' when abstract, '' when unnamed) of every listening Unix socket on the host."""
    out = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 7 and int(parts[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
            out[int(parts[6])] = parts[7] if len(parts) > 7 else ""
    return out


def _sample_listeners(root: int, tcp: set, unix: set, pids_seen: set) -> None:
    tcp_all, unix_all = _tcp_listeners(), _unix_listeners()
    for pid in _process_tree(root):
        for inode in _socket_inodes(pid):
            if inode in tcp_all:
                tcp.add((*tcp_all[inode], pid))
                pids_seen.add(pid)
            elif inode in unix_all:
                path = unix_all[inode]
                mode = None
                if path and not path.startswith("@"):
                    try:
                        mode = (stat.S_IMODE(os.stat(path).st_mode),
                                stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode))
                    except OSError:
                        mode = None  # already removed
                unix.add((path, mode, pid))


_RUN_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path

    from asyncflow_core.config.loader import load_config, resolve
    from asyncflow_core.flow.runtime import run_flow

    if __name__ == "__main__":
        run_dir, overrides = Path(sys.argv[1]), sys.argv[2:]
        summary = run_flow(resolve(load_config(Path({example!r}), overrides)), run_dir=run_dir, write_png=False)
        assert summary["steps"] == 2, summary
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads listening sockets from Linux /proc")
@pytest.mark.parametrize("store", ["multiprocess", "distributed"])
def test_every_listener_of_a_run_binds_to_loopback(store, tmp_path):
    """A real run (fsdp world size 2, `dist` transport) opens TCP listeners on 127.0.0.1/::1 only, Unix ones privately.

    The run is a separate process, watched from here through /proc while it
    runs: every TCP socket in LISTEN state held by it or any descendant (the
    fsdp ranks, the forkserver) must be on a loopback address, and every
    listening Unix socket must have a path that other users cannot reach
    (the socket or its directory closed to group and others).
    """
    pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed")
    script = tmp_path / "run.py"
    script.write_text(_RUN_SCRIPT.format(example=str(ARITHMETIC)))
    overrides = ["trainer.total_steps=2", "trainer.checkpoint_every=0", "trainer.export_final=false",
                 "data.prompts_per_step=4", "trainer.options.world_size=2", "weight_transport.name=dist",
                 f"store.name={store}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if store == "distributed":  # the store starts the torch.distributed group itself, from the environment
        overrides.append("store.options={init_process_group: true}")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    log = tmp_path / "run.log"
    with log.open("wb") as sink:  # a file, not a pipe: a pipe nobody reads until the end can fill and stall the run
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), *overrides], cwd=tmp_path,
                                env=env, stdout=sink, stderr=subprocess.STDOUT)
    tcp: set = set()
    unix: set = set()
    pids: set = set()
    deadline = time.monotonic() + 280
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            _sample_listeners(proc.pid, tcp, unix, pids)
            time.sleep(0.1)  # sampling period, not synchronisation: the run's end is what the loop waits for
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]
    public = sorted(t for t in tcp if t[0] not in ("127.0.0.1", "::1"))
    assert not public, f"listening on non-loopback addresses (ip, port, pid): {public}"
    # the sampler saw the run's listeners: the driver's (transport rendezvous) and the ranks' (fsdp rendezvous, gloo)
    assert proc.pid in pids and len(pids) >= 2, (tcp, pids)
    # connecting needs write permission on the socket and search permission on its directory
    exposed = sorted(u for u in unix if u[0].startswith("@")  # abstract: any local user can connect
                     or (u[1] is not None and u[1][0] & 0o022 and u[1][1] & 0o011))
    assert not exposed, f"Unix listeners reachable by other users (path, (socket mode, dir mode), pid): {exposed}"


def test_distributed_store_refuses_a_non_loopback_rendezvous(monkeypatch):
    """init_process_group: true starts a loopback-only group; a MASTER_ADDR on the network is refused, not bound."""
    import torch.distributed as dist

    from asyncflow_core.errors import ConfigError
    from asyncflow_core.store.deployments.config import DistributedStoreConfig
    from asyncflow_core.store.deployments.distributed import ensure_process_group

    if dist.is_initialized():
        pytest.skip("this process already has a torch.distributed group")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="MASTER_ADDR=10.1.2.3 is not a loopback address"):
        ensure_process_group(DistributedStoreConfig(init_process_group=True))
    assert not dist.is_initialized()
    monkeypatch.delenv("RANK")
    with pytest.raises(ConfigError, match="needs RANK"):
        ensure_process_group(DistributedStoreConfig(init_process_group=True))


def _hosted_stores_without_own_listener(path: Path) -> list[int]:
    """Lines of ``TCPStore(..., is_master=True)`` calls not given a socket bound by the caller (master_listen_fd)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] == "TCPStore":
            kw = {k.arg: k.value for k in node.keywords}
            master = kw.get("is_master", node.args[3] if len(node.args) > 3 else None)
            if isinstance(master, ast.Constant) and master.value is False or master is None:
                continue
            if "master_listen_fd" not in kw:
                out.append(node.lineno)
    return out


def test_every_hosted_tcpstore_listens_on_the_socket_the_project_bound():
    """torch's TCPStore server listens on every interface (``::``) whatever host it is given; bind it yourself.

    Bind a socket to 127.0.0.1 (or the configured address), ``listen()``,
    and pass ``master_listen_fd=sock.detach(), use_libuv=False`` (see
    ``init_loopback_process_group`` in asyncflow_core/store/deployments/distributed.py).
    """
    found = {p.relative_to(ROOT).as_posix(): lines for p in _python_files()
             if (lines := _hosted_stores_without_own_listener(p))}
    assert not found, f"TCPStore servers that would listen on all interfaces (file: lines): {found}"


# fields of registered plugin config models that name where to listen or connect, and why each is safe
_ADDRESS_FIELDS_ALLOWED = {
    ("store", "multiprocess", "address"): "a Unix socket path (the server's 0700 directory), never a TCP address",
    ("launcher", "ray", "address"): "joins a Ray cluster someone started (outbound); unset starts a loopback-only Ray",
    ("rollout_engine", "sglang", "url"): "a server to call (outbound); a launched server binds 127.0.0.1",
}
_ADDRESS_WORDS = ("host", "addr", "address", "bind", "listen", "interface", "ifname", "ip", "url", "endpoint")


def test_no_plugin_option_opens_a_network_address_unreviewed():
    """A new option that chooses a host or address must be reviewed here (and its default be loopback)."""
    from asyncflow_core.plugins import get_plugin_manager

    found = {}
    for reg in get_plugin_manager().all_registrations():
        for field in getattr(reg.record.config_model, "model_fields", {}):
            if any(w in _ADDRESS_WORDS for w in field.lower().split("_")):
                found[(reg.record.kind.value, reg.name, field)] = True
    unreviewed = sorted(set(found) - set(_ADDRESS_FIELDS_ALLOWED))
    assert not unreviewed, (
        f"plugin options that choose a network address: {unreviewed}; make the default loopback, refuse other "
        "addresses without an explicit opt-in, and add them to _ADDRESS_FIELDS_ALLOWED with the reason")


# ============================================================ 2. the store's control channel


def test_multiprocess_arena_is_private():
    """The arena (column bytes of every row) sits beside the socket: 0600, in the 0700 directory."""
    from asyncflow_core.store.deployments.multiprocess import ARENA_NAME, MultiprocessServer

    server = MultiprocessServer(arena_mb=1)
    try:
        arena = os.path.join(server.directory, ARENA_NAME)
        assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(arena).st_mode) & 0o077 == 0, oct(os.stat(arena).st_mode)
    finally:
        server.stop()


# ============================================================ 3. no unpickling of received bytes

# calls that deserialize executable objects; dotted names as written in the source
_UNPICKLING_CALLS = {
    "pickle.loads", "pickle.load", "pickle.Unpickler", "cPickle.loads", "cloudpickle.loads", "cloudpickle.load",
    "dill.loads", "dill.load", "marshal.loads", "marshal.load", "shelve.open", "jsonpickle.decode",
    "yaml.unsafe_load", "yaml.full_load",
}
# torch.distributed collectives that pickle objects across ranks (each unpickles what a peer sent)
_OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                       "recv_object_list", "send_object_list"}
# (file, call) -> (count, why it is safe)
_ALLOWED = {
    ("asyncflow_core/launchers/ranks.py", "pickle.loads"): (
        1, "the driver reads its rank processes' replies from the anonymous pipes it created when it started them "
           "(same user, no socket, no address anyone else can open)"),
    ("asyncflow_core/launchers/ray/ranks.py", "pickle.loads"): (
        1, "a rank actor decodes the reply its own rank thread wrote into an in-process pipe (both ends in one "
           "process, no socket, no address); what reaches the actor is a Ray call from the trainer actor that owns it"),
    ("asyncflow_core/launchers/rank_worker.py", "pickle.loads"): (
        2, "a rank (fsdp, megatron) reads commands (and the pickled algorithm) from the anonymous pipe to the driver "
           "that started it with the core's rank group (as a Ray rank actor: from the in-process pipe its actor "
           "feeds with the owning trainer actor's calls)"),
    ("asyncflow_core/flow/env_workers.py", "Connection.recv"): (
        2, "the environment pool and the worker processes it spawned (multiprocessing spawn context) talk over the "
           "anonymous Pipe created before the spawn: same user, no socket, no address anyone else can open"),
    ("asyncflow_core/launchers/ray/actors.py", "pickle.loads"): (
        1, "a round trip of bytes the actor itself just produced with pickle.dumps (does this exception survive "
           "Ray's own serialisation?); nothing received is decoded"),
}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _findings(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("multiprocessing.connection",
                                                                 "multiprocessing.managers"):
            for alias in node.names:
                if alias.name in ("Listener", "Client", "BaseManager", "SyncManager"):
                    out.append((f"{node.module}.{alias.name}", node.lineno))
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        if name in _UNPICKLING_CALLS:
            out.append((name, node.lineno))
        elif name.endswith("torch.load"):
            weights_only = kw.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                out.append(("torch.load without weights_only=True", node.lineno))
        elif name in ("np.load", "numpy.load"):
            allow = kw.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                out.append(("numpy.load with allow_pickle", node.lineno))
        elif name == "yaml.load":
            loader = _dotted(kw["Loader"]) if "Loader" in kw else ""
            if not loader.endswith("SafeLoader"):
                out.append(("yaml.load without SafeLoader", node.lineno))
        elif name.split(".")[-1] in _OBJECT_COLLECTIVES:
            out.append((f"torch.distributed.{name.split('.')[-1]}", node.lineno))
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "recv" and not node.args and not node.keywords:
            out.append(("Connection.recv", node.lineno))  # socket.recv takes a size; Connection.recv() unpickles
    return out


def test_scanner_finds_what_it_must():
    """The scanner itself: each forbidden form is reported, the safe forms are not."""
    code = textwrap.dedent("""
        import pickle, torch, numpy as np, yaml
        from multiprocessing.connection import Listener
        pickle.loads(b"")
        torch.load("f")
        torch.load("f", weights_only=False)
        torch.load("f", weights_only=True)
        np.load("f", allow_pickle=True)
        np.load("f")
        yaml.load(s)
        yaml.load(s, Loader=yaml.SafeLoader)
        conn.recv()
        sock.recv(4096)
        torch.distributed.broadcast_object_list(objs)
    """)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"asyncflow-scan-{os.getpid()}.py"
    path.write_text(code)
    try:
        kinds = sorted(k for k, _ in _findings(path))
    finally:
        path.unlink()
    assert kinds == sorted([
        "multiprocessing.connection.Listener", "pickle.loads", "torch.load without weights_only=True",
        "torch.load without weights_only=True", "numpy.load with allow_pickle", "yaml.load without SafeLoader",
        "Connection.recv", "torch.distributed.broadcast_object_list",
    ]), kinds


def test_nothing_unpickles_received_bytes_outside_the_allow_list():
    """Deserialisers that run code (pickle & co., torch.load without weights_only, object collectives) are banned.

    Bytes from a socket are decoded as JSON + raw buffers (the store's codec)
    or checked safetensors/JSON manifests (the weight transports). The
    allowed uses are pipes between a driver and the processes it started.
    """
    counts: dict[tuple[str, str], list[int]] = {}
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        for kind, line in _findings(path):
            counts.setdefault((rel, kind), []).append(line)
    unexpected = {k: v for k, v in counts.items() if len(v) > _ALLOWED.get(k, (0, ""))[0]}
    assert not unexpected, (
        f"new uses of deserialisers that can run code (file, call) -> lines: {unexpected}; decode received bytes "
        "with a data-only format (JSON, safetensors, raw buffers), or, for a private pipe to a process you "
        "started, add an entry to _ALLOWED saying why it is safe")
    stale = sorted(k for k in _ALLOWED if k not in counts and (ROOT / k[0]).exists())
    assert not stale, f"allow-list entries that no longer match anything (remove them): {stale}"


def test_fsdp_pipes_are_anonymous_pipes_to_started_ranks():
    """The allowed unpickling happens on ``Pipe()`` ends made by the driver for the ranks it starts, not sockets."""
    source = (ROOT / "asyncflow_core/launchers/ranks.py").read_text()
    assert "ctx.Pipe(duplex=True)" in source and "ctx.Process(" in source
    tree = ast.parse(source)
    names = {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not {n for n in names if n.split(".")[-1] in ("Listener", "Client", "socket", "create_connection")}


# ============================================================ 4. Ray's token authentication


_RAY_AUTH_SET = re.compile(r"""RAY_AUTH_MODE["']?[\s\]:=,)]*["']?(\w+)|["']AUTH_MODE["']\s*:\s*["'](\w+)""")


def _ray_auth_values(text: str) -> list[str]:
    """Values RAY_AUTH_MODE (or the system-config key AUTH_MODE) is given in ``text``."""
    return [(m.group(1) or m.group(2) or "").lower() for m in _RAY_AUTH_SET.finditer(text)]


def test_ray_auth_scanner_sees_every_way_of_setting_it():
    assert _ray_auth_values(textwrap.dedent("""
        os.environ["RAY_AUTH_MODE"] = "disabled"
        monkeypatch.setenv('RAY_AUTH_MODE', 'disabled')
        ray.init(runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}}, _system_config={"AUTH_MODE": "disabled"})
        RAY_AUTH_MODE=disabled ray start --head
        env RAY_AUTH_MODE=token
    """)) == ["disabled"] * 5 + ["token"]


def test_project_never_switches_ray_auth_off():
    """No file of the project sets RAY_AUTH_MODE (or Ray's system config AUTH_MODE) to anything but ``token``."""
    offenders = []
    files = _python_files((*SOURCE_DIRS, "tests", "examples", "benchmarks"))
    files += [ROOT / "Makefile", ROOT / "pyproject.toml", *sorted((ROOT / "examples").rglob("*.yaml"))]
    for path in files:
        if path.resolve() == Path(__file__).resolve():
            continue
        values = _ray_auth_values(path.read_text(errors="replace"))
        offenders += [(path.relative_to(ROOT).as_posix(), v) for v in values if v != "token"]
    assert not offenders, f"these turn Ray's token authentication off: {offenders}"


@pytest.mark.slow
def test_local_ray_starts_with_token_auth(tmp_path):
    """``init_local_ray()`` leaves Ray's default on: a new local cluster uses token authentication."""
    ray = pytest.importorskip("ray")
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode  # noqa: F401
    except ImportError:
        pytest.skip(f"Ray {ray.__version__} has no token authentication (loopback binding is all there is)")

    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        pytest.skip(f"RAY_AUTH_MODE={os.environ['RAY_AUTH_MODE']} was set by the user")
    code = textwrap.dedent("""
        import os, ray
        from ray._raylet import AuthenticationMode, get_authentication_mode
        from asyncflow_core.store.deployments.ray_store import init_local_ray
        init_local_ray(num_cpus=1)
        try:
            print("MODE", get_authentication_mode() == AuthenticationMode.TOKEN, os.environ.get("RAY_AUTH_MODE"))
        finally:
            ray.shutdown()
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MODE True token" in done.stdout, (ray.__version__, done.stdout, done.stderr[-2000:])


# ============================================================ 5. secrets stay out of run directories and logs


@pytest.mark.parametrize("key", [
    "api_key", "apiKey", "API_KEY", "WANDB_API_KEY", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "hf_token",
    "HF_TOKEN", "token", "auth_token", "ASYNCFLOW_STORE_TOKEN", "password", "db_password", "client_secret",
    "secret", "credentials", "private_key", "accessToken", "auth", "RAY_AUTH_TOKEN",
])
def test_secret_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", [
    "max_new_tokens", "tokens_per_s", "answer_key", "prompt_key", "sort_key", "key", "pad_token_id", "eos_token",
    "bos_token", "token_env", "api_key_file", "password_path", "secret_name", "tokenizer", "TOKENIZERS_PARALLELISM",
    "SSH_AUTH_SOCK", "RAY_AUTH_MODE", "wandb_project", "trust_remote_code", "name",
])
def test_settings_that_are_not_secrets(key):
    """Ordinary settings stay in config.yaml: redacting them would break --resume."""
    assert not is_secret_key(key)


_keys = st.one_of(
    st.sampled_from(["api_key", "hf_token", "password", "client_secret", "WANDB_API_KEY", "credentials"]),
    st.sampled_from(["lr", "max_new_tokens", "answer_key", "name", "path", "options", "pad_token_id"]),
    st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12),
)
_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(min_size=0, max_size=20))
_configs = st.recursive(
    st.dictionaries(_keys, _leaves, max_size=5),
    lambda inner: st.dictionaries(_keys, st.one_of(_leaves, inner, st.lists(inner, max_size=3)), max_size=5),
    max_leaves=30,
)


def _walk(value, secret=False):
    """(leaf, under a secret key) for every leaf."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, secret or is_secret_key(k))
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v, secret)
    else:
        yield value, secret


@settings(max_examples=200, deadline=None)
@given(_configs)
def test_redact_config_removes_every_secret_and_keeps_the_rest(config):
    out = redact_config(config)
    before, after = list(_walk(config)), list(_walk(out))
    assert len(before) == len(after)  # same shape
    for (old, secret), (new, _) in zip(before, after, strict=True):
        if secret and old is not None and not isinstance(old, bool) and old != "":
            assert new == REDACTED
        elif isinstance(old, str):
            assert new == Redactor().text(old)  # only URL passwords and known token formats go
        else:
            assert new == old
    assert redact_config(out) == out  # idempotent
    assert not secret_values(out) - {REDACTED}  # what was under a secret key is gone


_secret_text = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=8, max_size=24)


@settings(max_examples=200, deadline=None)
@given(st.lists(_secret_text, min_size=1, max_size=4), st.lists(st.text(max_size=12), min_size=1, max_size=6))
def test_redactor_leaves_no_secret_in_text(secrets, filler):
    secrets = [s for s in secrets if s not in REDACTED]
    r = Redactor(secrets)
    text = "".join(f + (secrets[i % len(secrets)] if secrets else "") for i, f in enumerate(filler))
    out = r.text(text)
    for s in secrets:
        assert s not in out, (s, text, out)
    assert r.text(out) == out or any(s in REDACTED for s in secrets)


def test_redactor_knows_token_formats_and_url_passwords():
    r = Redactor()
    hf = "hf_" + "a1B2" * 9
    text = f"token {hf} at https://user:hunter2hunter2@example.invalid/x and sk-{'x' * 30} AKIAABCDEFGHIJKLMNOP"
    out = r.text(text)
    assert hf not in out and "hunter2hunter2" not in out and "sk-xxx" not in out and "AKIAABCD" not in out
    assert "https://user:<redacted>@example.invalid/x" in out
    assert r.text("max_new_tokens=3 lr=0.05 runs/toy-grpo") == "max_new_tokens=3 lr=0.05 runs/toy-grpo"


def test_redacted_paths_name_what_resume_must_be_given_again():
    cfg = {"reward": {"name": "judge", "options": {"api_key": "abc", "url": "https://u:pw@h/"}}, "x": [{"password": 1}]}
    out = redact_config(cfg)
    assert out["reward"]["options"]["url"] == "https://u:<redacted>@h/"
    assert redacted_paths(out) == ["reward.options.api_key", "reward.options.url", "x[0].password"]


def test_log_records_are_redacted_whatever_the_handler(caplog):
    secret = "s3cr3t-value-for-a-log-line"
    r = Redactor([secret])
    install_log_redaction()
    from asyncflow_core.config import redact

    redact.default_redactor().add([secret])
    with caplog.at_level(logging.INFO):
        logging.getLogger("asyncflow.test").warning("calling %s with key %s", "judge", secret)
        try:
            raise RuntimeError(f"401 for {secret}")
        except RuntimeError:
            logging.getLogger("asyncflow.test").exception("failed")
    assert secret not in caplog.text and REDACTED in caplog.text, caplog.text
    assert r.text(secret) == REDACTED


def test_telemetry_files_are_redacted(tmp_path):
    from asyncflow_core.flow.telemetry import MetricsWriter, Timeline

    secret = "tok-1234567890-abcdef"
    r = Redactor([secret])
    w = MetricsWriter(tmp_path / "metrics.jsonl", redactor=r)
    w.write({"step": 1, "note": f"error with {secret}", f"reward/{secret}": 1.0})
    w.close()
    t = [0.0]
    tl = Timeline(lambda: t[0])
    tl.add(f"rollout-{secret}", "generate", 0.0, 1.0)
    tl.write(tmp_path, redactor=r)
    for name in ("metrics.jsonl", "trace.json", "spans.jsonl"):
        text = (tmp_path / name).read_text()
        assert secret not in text and REDACTED in text, name
    assert w.records[0]["note"].endswith(secret)  # in memory the record is untouched


def test_config_show_prints_no_secret(tmp_path, monkeypatch, fresh_plugins, capsys):
    """``asyncflow config show`` output ends up in issues and CI logs: secret-keyed values are redacted."""
    from asyncflow_core.cli.main import main
    from asyncflow_core.plugins import get_plugin_manager

    module = _judge_plugin("asyncflow_test_judge")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    get_plugin_manager().register_module(module, distribution="tests", version="0", name=module.__name__)
    key = "sk-" + "Qw8" * 12
    with pytest.raises(SystemExit) as exit_:
        main(["config", "show", str(TOY), "reward.name=judge", f"reward.options={{api_key: {key}}}"])
    printed = capsys.readouterr()
    assert exit_.value.code in (0, None), printed.err
    assert "api_key: <redacted>" in printed.out and key not in printed.out + printed.err


# a reward that calls a (pretend) remote judge with an API key, like an LLM-as-judge reward would


def _judge_plugin(module_name: str):
    import types

    from pydantic import BaseModel, ConfigDict, Field

    from asyncflow_core.interfaces import Reward
    from asyncflow_core.plugins import RewardBackend, hookimpl

    class JudgeConfig(BaseModel):
        model_config = ConfigDict(extra="forbid")
        api_key: str = Field(description="Key of the judge service.")
        endpoint: str = Field("https://judge.invalid/v1", description="Judge URL.")
        fail_first: int = Field(0, description="Fail this many calls with an error quoting the key.")

    class JudgeReward(Reward):
        def __init__(self, config: JudgeConfig) -> None:
            self.config = config
            self.calls = 0

        def score(self, sample):
            self.calls += 1
            if self.calls <= self.config.fail_first:
                raise PermissionError(f"401 from {self.config.endpoint} for key {self.config.api_key}")
            return float(len(sample.completion) % 2)

    module = types.ModuleType(module_name)

    @hookimpl
    def asyncflow_rewards():
        yield RewardBackend(name="judge", factory=JudgeReward, config_model=JudgeConfig, description="test judge")

    module.asyncflow_rewards = asyncflow_rewards
    return module


@pytest.mark.slow
@pytest.mark.parametrize("fail_first", [2, 10**6], ids=["completes", "stops-on-failures"])
def test_a_run_writes_no_secret_into_its_directory_or_logs(fail_first, tmp_path, monkeypatch, fresh_plugins, caplog,
                                                          capsys):
    """Fake secrets in the config (a reward's api_key, a URL password) and the environment reach no file or output.

    ``asyncflow run`` in this process: the reward quotes its key in the errors
    it raises; ``stops-on-failures`` fails every sample, so the run halts and
    the reason (which quotes the key) goes to summary.json and the terminal.
    """
    from asyncflow_core.cli.main import main
    from asyncflow_core.plugins import get_plugin_manager

    key = "sk-" + "Zq9" * 12
    url_password = "pw-" + "Kx7" * 6
    wandb_key = "0f" * 20
    hf_token = "hf_" + "Yt5" * 11
    monkeypatch.setenv("WANDB_API_KEY", wandb_key)
    monkeypatch.setenv("HF_TOKEN", hf_token)
    module = _judge_plugin("asyncflow_test_judge")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    get_plugin_manager().register_module(module, distribution="tests", version="0", name=module.__name__)

    run = tmp_path / "run"
    argv = ["run", str(TOY), "--run-dir", str(run), "--no-progress",
            "trainer.total_steps=3", f"data.options.path={ROOT / 'examples/data/toy_prompts.jsonl'}",
            "reward.name=judge",
            f"reward.options={{api_key: {key}, endpoint: 'https://bot:{url_password}@judge.invalid/v1', "
            f"fail_first: {fail_first}}}"]
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_:
        main(argv)
    printed = capsys.readouterr()
    assert (exit_.value.code in (0, None)) == (fail_first == 2), printed.err[-2000:]
    saved = (run / "config.yaml").read_text()
    assert REDACTED in saved and "max_new_tokens" in saved  # the key is replaced, ordinary settings are kept
    assert (run / "summary.json").is_file()
    if fail_first > 2:
        assert "401 from" in printed.err + (run / "summary.json").read_text()  # the reason is there, redacted
    files = sorted(p for p in run.rglob("*") if p.is_file())
    for secret in (key, url_password, wandb_key, hf_token):
        for path in files:
            assert secret.encode() not in path.read_bytes(), f"{secret!r} leaked into {path.relative_to(run)}"
        assert secret not in caplog.text, f"{secret!r} leaked into a log line"
        assert secret not in printed.out + printed.err, f"{secret!r} leaked onto the terminal"
