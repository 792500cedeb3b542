"""Figures logged with each trainer round (matplotlib, without pyplot: Agg rendering with no
global backend state, safe off the main thread)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from online.trainer.round import RoundResult


def replay_plot(result: RoundResult, path: Path) -> Path:
    """PNG of per-position acceptance, candidate vs champion, on the held-out slice."""
    # Figure without pyplot: Agg rendering with no global backend state, safe off the main thread.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label, m in ((f"candidate {result.candidate_version}", result.candidate),
                     (f"champion v{result.champion_version}", result.champion)):
        xs = range(1, len(m.per_position_acceptance) + 1)
        ax.plot(xs, m.per_position_acceptance, marker="o",
                label=f"{label} (mean acc. len {m.mean_acceptance_length:.2f})")
    k = max(len(result.candidate.per_position_acceptance), len(result.champion.per_position_acceptance))
    ax.set_xticks(range(1, k + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / verify steps")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"held-out replay ({result.candidate.requests} requests): "
                 f"{'promoted' if result.promoted else 'not promoted'}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
