"""Starting a real uvicorn server on a free 127.0.0.1 port in a thread, for the serve tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.serve.server import make_server
from pagedkv.testing import tiny_llama

MODEL = "tiny"


def tiny_chat_engine(tokenizer: Any, plugins: tuple = (), **config: Any) -> Engine:
    """The tiny random Llama sized to the byte-level tokenizer (its EOS is <|im_end|>)."""
    config = {"device": "cpu", "num_blocks": 512, "block_size": 8, **config}
    model = tiny_llama(vocab_size=len(tokenizer))
    return Engine(EngineConfig(**config), model=model, tokenizer=tokenizer, plugins=plugins)


@contextlib.contextmanager
def running_server(engine: Engine, **options: Any) -> Iterator[tuple[str, Any]]:
    """Yield (base URL, uvicorn server) while a server for ``engine`` runs in a thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(engine, MODEL, port=port, log_level="warning", **options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
