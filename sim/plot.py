"""``engine simulate --plot``: KV blocks in use over simulated time, paged against static, with matplotlib.

Time is simulated seconds (the step-time model's clock), so the paged and static runs share one axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.core.errors import ConfigError


def plot_blocks(path: str | Path, report: dict) -> str:
    """Write the plot (format from the file's suffix: .png, .svg, .pdf); returns a one-line caption."""
    plt = _pyplot()
    fig = blocks_figure(report)
    try:
        fig.savefig(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot write the plot to {path}: {exc}") from None
    finally:
        plt.close(fig)
    return f"plot: {path}"


def blocks_figure(report: dict) -> Any:
    """The matplotlib figure: labelled axes, a legend, the budget line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4), dpi=110)
    paged = report["paged"]
    runs = [("paged", paged, "#4272c4")]
    if report.get("static"):
        runs.append(("static (max-length reservation)", report["static"], "#e67e22"))
    for label, result, color in runs:
        t, used = list(result["series"]["t"]), list(result["series"]["blocks_used"])
        if label == "paged":
            ax.fill_between(t, used, step="post", color=color, alpha=0.25, linewidth=0)
        ax.step(t, used, where="post", color=color, linewidth=1.4, label=f"{label}: peak {max(used, default=0)}")
    ax.axhline(paged["num_blocks"], color="#666666", linestyle="--", linewidth=1,
               label=f"KV budget: {paged['num_blocks']} blocks")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV blocks in use")
    ax.set_title("KV cache blocks in use over the run")
    ax.set_ylim(0, paged["num_blocks"] * 1.08)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    return fig


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'pagedkv[plot]'") from None
    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    return plt
