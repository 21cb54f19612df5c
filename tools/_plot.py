"""matplotlib for the tools, imported lazily (the ``plot`` extra), and one way to write a figure."""
from __future__ import annotations

from typing import Any, Optional


def pyplot() -> Optional[Any]:
    """``matplotlib.pyplot`` on the Agg backend, or None (with a message) when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the PNG (pip install flodl-opt[plot])")
        return None
    return plt


def save(fig: Any, path: str, title: str, dpi: int = 110) -> str:
    """Title, tight layout, write ``path``, free the figure."""
    import matplotlib.pyplot as plt
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
