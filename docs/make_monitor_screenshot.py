"""Regenerate ``docs/monitor.svg``: a tiny random Llama run traced to a file, replayed into the dashboard.

The engine runs on CPU over :func:`pagedkv.testing.tiny_llama` (nothing is downloaded) with a small
pool, swap space and prefix caching, so the picture has running and swapped requests, shared and
cached blocks; one request is selected. The trace stops mid-run (its ``end`` line is dropped), and
the dashboard replays it at full speed in a 130x38 terminal and saves what it draws as SVG.

    .venv/bin/python docs/make_monitor_screenshot.py [OUT.svg]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

STEPS = 34
SIZE = (130, 38)


def record(path: Path) -> None:
    import torch

    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine
    from pagedkv.core.sample.sampling_params import SamplingParams
    from pagedkv.plugins import telemetry
    from pagedkv.testing import tiny_llama

    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=160, swap_space="2MiB",
                                 enable_prefix_caching=True, trace=str(path)), model=tiny_llama())
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(1, 200, (12,), generator=gen).tolist()  # a shared prefix: shared and cached blocks
    for step in range(STEPS):
        if step in (0, 4):  # two waves: the second finds the first's prefix blocks computed (prefix hits)
            for i, length in enumerate((10, 18, 0, 48, 6, 14) if step == 0 else (64, 4, 22, 28, 40, 12)):
                prompt = system + torch.randint(1, 200, (length,), generator=gen).tolist()
                params = SamplingParams(max_tokens=30 + 3 * i, ignore_eos=True, n=2 if length == 48 else 1)
                engine.add_request(prompt, params)
        engine.step()
    telemetry.close(engine)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if '"type":"end"' not in line))


async def screenshot(trace: Path, out: Path) -> None:
    from pagedkv.monitor.app import MonitorApp, load_replay

    app = MonitorApp(trace=load_replay(trace), speed=0)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(1.0)
        app.action_select("3")  # the two-sample request: its blocks solid, the rest dimmed, its table listed
        await pilot.pause(0.2)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("monitor.svg")).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "doc.ndjson"
        record(trace)
        asyncio.run(screenshot(trace, out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
