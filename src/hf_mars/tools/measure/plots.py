"""The style of hf_mars's plots against τ (`hf-mars bench`'s bench.png, `hf-mars eval`'s eval.png): side-by-side
panels, τ decreasing to the right (1 = plain AR on the left), a light grid, saved as PNG."""

from __future__ import annotations

from pathlib import Path


def figure(ylabels: list[str], xlabel: str, hint: str):
    """`(pyplot, figure, axes)`: one panel per y label, `xlabel` on every x axis, a light grid. `hint` says what needs
    matplotlib."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(f"{hint}: pip install 'hf_mars[bench]'") from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ylabels), figsize=(5 * len(ylabels), 4))
    axes = list(axes) if len(ylabels) > 1 else [axes]
    for ax, label in zip(axes, ylabels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    return plt, fig, axes


def tau_figure(ylabels: list[str], hint: str):
    """`figure` against τ, decreasing to the right (1 = plain AR on the left)."""
    plt, fig, axes = figure(ylabels, "τ", hint)
    for ax in axes:
        ax.invert_xaxis()
    return plt, fig, axes


def save_figure(plt, fig, path: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
