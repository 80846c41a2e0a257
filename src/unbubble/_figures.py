"""The one style of unbubble's figures: a run's loss.png, ``unbubble report``'s figures and the
experiments' (their ``save_figure``). Drawn on matplotlib's Agg canvas (no display, no pyplot
state); losses in nats per token, a light grid, a small legend, 100 dpi."""

from __future__ import annotations

from pathlib import Path

#: The y label of every loss axis.
LOSS_LABEL = "loss (nats per token)"


def new_figure(width: float, height: float):
    """A matplotlib ``Figure`` of ``width`` × ``height`` inches on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def plot_validation(ax, xs, losses, color=None, label: str = "validation") -> None:
    """Validation losses as markers joined by a dashed line (training curves are solid lines)."""
    ax.plot(xs, losses, "o--", color=color, ms=4, lw=1, label=label)


def save(fig, ax, path: Path, dpi: int = 100, grid: str | None = "both") -> Path:
    """Finishes ``ax`` in the house style (grid on ``grid``'s axes, ``None``: none; legend at font
    size 7 where there are labelled lines) and writes ``fig`` as a PNG to ``path``."""
    if grid is not None:
        ax.grid(alpha=0.3, axis=grid)
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return path
