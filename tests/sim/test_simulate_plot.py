"""engine simulate --plot: a figure that needs no caption (labelled axes, legend, the budget line)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from pagedkv.sim.plot import blocks_figure, plot_blocks  # noqa: E402
from pagedkv.sim.simulate import SimSetup, simulate  # noqa: E402
from pagedkv.sim.workload import builtin_workload  # noqa: E402


@pytest.fixture(scope="module")
def report():
    return simulate(builtin_workload("alpaca", 60, seed=0), SimSetup(num_blocks=48, max_model_len=512))


def test_figure_has_labelled_axes_legend_and_the_budget_line(report):
    import matplotlib.pyplot as plt

    fig = blocks_figure(report)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "simulated time (s)" and ax.get_ylabel() == "KV blocks in use"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == f"paged: peak {max(report['paged']['series']['blocks_used'])}"
    assert legend[1].startswith("static") and legend[2] == "KV budget: 48 blocks"
    paged_line = ax.get_lines()[0]
    assert list(paged_line.get_xdata()) == list(report["paged"]["series"]["t"])  # simulated seconds on x
    assert list(paged_line.get_ydata()) == list(report["paged"]["series"]["blocks_used"])
    budget = ax.get_lines()[-1]
    assert set(budget.get_ydata()) == {48}
    plt.close(fig)


def test_plot_file_is_written_in_the_format_its_suffix_names(report, tmp_path):
    png, svg = tmp_path / "b.png", tmp_path / "b.svg"
    assert plot_blocks(png, report) == f"plot: {png}"
    plot_blocks(svg, report)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert b"simulated time (s)" in svg.read_bytes() or b"<svg" in svg.read_bytes()[:400]


def test_an_unwritable_plot_path_is_one_clear_error(report, tmp_path):
    from pagedkv.core.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot write the plot"):
        plot_blocks(tmp_path / "missing" / "b.png", report)
