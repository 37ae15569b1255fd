"""Start an SGLang server process on 127.0.0.1, wait until it is ready, stop it (the whole process group)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncflow_core.errors import ConfigError, EngineError
from asyncflow_sglang.client import ServerError, SGLangClient
from asyncflow_sglang.config import LaunchConfig, SGLangRolloutConfig

HOST = "127.0.0.1"


class ServerProcess:
    """A server this engine started: its URL, process and log file."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group (SGLang starts scheduler and detokenizer children); SIGKILL later."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


def launch_arguments(config: SGLangRolloutConfig, port: int) -> list[str]:
    """The ``launch_server`` command line for these options (127.0.0.1 only)."""
    launch: LaunchConfig = config.launch  # type: ignore[assignment]
    model_path = launch.model_path or (config.model.path if config.model is not None else None)
    if model_path is None:
        raise ConfigError(
            "sglang launch needs a model: set rollout.options.launch.model_path or the run's model.path "
            "(a local checkpoint directory; SGLang cannot serve model.hf_config random weights)"
        )
    dtype = launch.dtype or (config.model.dtype if config.model is not None else None)
    command = launch.command or [sys.executable, "-m", "sglang.launch_server"]
    args = [*command, "--model-path", model_path, "--host", HOST, "--port", str(port),
            "--tp-size", str(launch.tp_size), "--dp-size", str(launch.dp_size)]
    if dtype in ("float32", "float") and "--attention-backend" not in launch.extra_args:
        raise ConfigError(
            "dtype float32 (from the run's model.dtype): SGLang's default attention backends (FlashInfer, FA3) run "
            "half precision only; set rollout.options.launch.dtype: bfloat16, or name a backend that takes float32 "
            "(launch.extra_args: ['--attention-backend', 'triton'])"
        )
    if launch.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(launch.mem_fraction_static)]
    if dtype is not None:
        args += ["--dtype", dtype]
    if launch.random_seed is not None:
        args += ["--random-seed", str(launch.random_seed)]
    if launch.deterministic_inference:
        args += ["--enable-deterministic-inference"]
    if config.memory_saver:
        args += ["--enable-memory-saver"]
    if config.api_key:
        args += ["--api-key", config.api_key]
    if config.admin_api_key:
        args += ["--admin-api-key", config.admin_api_key]
    return [*args, *launch.extra_args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


async def start_server(config: SGLangRolloutConfig) -> ServerProcess:
    """Launch the server and return once ``/ready`` answers 200; EngineError (with its log tail) otherwise."""
    launch: LaunchConfig = config.launch  # type: ignore[assignment]
    port = launch.port or free_port()
    args = launch_arguments(config, port)
    if launch.log_path is not None:
        log_path = Path(launch.log_path)
    else:
        fd, name = tempfile.mkstemp(prefix="asyncflow-sglang-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    env = dict(os.environ)
    # SGLang would then return log-probs before temperature scaling: not asyncflow's convention
    env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
    with open(log_path, "ab") as log:
        try:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as exc:
            raise EngineError(f"could not start the SGLang server ({' '.join(args[:3])} ...): {exc}") from exc
    server = ServerProcess(process, f"http://{HOST}:{port}", log_path)
    try:
        await wait_healthy(server, config, launch.startup_timeout_s)
    except BaseException:
        server.stop(grace_s=5.0)
        raise
    return server


async def wait_healthy(server: ServerProcess, config: SGLangRolloutConfig, timeout_s: float) -> None:
    """Poll ``GET /ready``: 200 once SGLang finished its warm-up (``ServerStatus.Up``) and is not paused. Not
    ``/health``, which generates a token per call once the server is up."""
    client = SGLangClient(server.url, connect_timeout_s=2.0, max_connections=2)
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    try:
        while True:
            code = server.process.poll()
            if code is not None:
                raise EngineError(
                    f"the SGLang server exited with code {code} while starting; last log lines "
                    f"({server.log_path}):\n{server.log_tail()}"
                )
            try:
                await client.get("/ready", timeout_s=5.0)
                return
            except ServerError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(
                    f"the SGLang server at {server.url} was not ready within {timeout_s:g}s "
                    f"(launch.startup_timeout_s); last log lines ({server.log_path}):\n{server.log_tail()}"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
    finally:
        await client.close()
