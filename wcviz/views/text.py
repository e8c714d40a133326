"""Verdicts as terminal text: the layer × rank grid a person reads during an incident.

::

    rank     0 1 2 3
    pp       0 0 1 1
    tp       0 1 0 1
    embed    . . - -
    layer 0  . U - -
    layer 1  - - x C
    head     - - . .
    legend: C corrupted  U unwritten  x missing  . match  - not held
    C corrupted  1 on 1 rank: r3 pp1 tp1
    U unwritten  2 on 2 ranks: r1 pp0 tp1, r3 pp1 tp1
    x missing    1 on 1 rank: r2 pp1 tp0
    . match      5 on 4 ranks

A rank coordinate of several digits is written downwards (tens above units), so
every rank takes two characters: 45 ranks fit 100 columns. A rank known only by its
URL (no coordinates: an agent that never answered) gets a number on a ``url`` line,
and a last line names the URL of each number (``url 0 http://node-a:8001``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pandas as pd

from wcviz._text import listing, plural
from wcviz.verdicts import status_parts
from wcviz.views._grid import SEVERITY, Grid, grid_of, keep_mask, worst_severity

__all__ = ["MARKS", "NOT_HELD", "layer_rank_text", "status_counts_text"]

MARKS = {
    "corrupted": "C",
    "mismatch": "M",
    "drift": "D",
    "unwritten": "U",
    "missing": "x",
    "empty": "0",
    "unreachable": "?",
    "unexpected": "+",
    "unproven": "~",
    "match": ".",
}
NOT_HELD = "-"  # the rank holds nothing of that part
FILTERED = "/"  # the rank holds that part, but a filter left out every row of it
assert set(MARKS) == set(SEVERITY)


def _url_numbers(lay: Grid) -> dict[str, int]:
    """Rank label -> its number on the ``url`` line, for the ranks known only by URL (in grid order)."""
    urls = [r for r, u in zip(lay.ranks, lay.coords["url"]) if not pd.isna(u)]
    return {r: i for i, r in enumerate(urls)}


def _header(lay: Grid, shown: list[str]) -> tuple[list[tuple[str, list[str]]], int]:
    """Header lines as (label, one string per rank column) and the cell width."""
    if not lay.located:
        return [("rank", list(shown))], max(len(r) for r in shown)
    lines: list[tuple[str, list[str]]] = []
    numbers = _url_numbers(lay)
    columns = [(c, ["" if pd.isna(x) else str(int(x)) for x in lay.coords.loc[shown, c]]) for c in lay.used]
    if any(r in numbers for r in shown):  # ranks without coordinates: a number each, named under the grid
        columns.append(("url", [str(numbers[r]) if r in numbers else "" for r in shown]))
    for c, values in columns:
        digits = max(len(x) for x in values)
        for k in range(digits):  # tens above units: one character per rank
            lines.append((c if k == digits - 1 else "", [x.rjust(digits)[k] for x in values]))
    return lines, 1


def _pick(worst: pd.DataFrame, max_ranks: int | None) -> list[str]:
    """The ranks to draw: all of them, or the worst ``max_ranks`` (identity order breaks ties), in identity order."""
    ranks = list(worst.columns)
    if max_ranks is None or len(ranks) <= max_ranks:
        return ranks
    if max_ranks < 1:
        raise ValueError(f"max_ranks must be at least 1, got {max_ranks}")
    col_worst = worst.min().fillna(len(SEVERITY)).astype(int)
    chosen = set(sorted(ranks, key=lambda r: (col_worst[r], ranks.index(r)))[:max_ranks])
    return [r for r in ranks if r in chosen]


def _totals(lay: Grid) -> list[str]:
    """One line per status that occurs: its rows, and the ranks it is on."""
    rows = lay.cells.drop_duplicates("row")
    present = [(i, s) for i, s in enumerate(SEVERITY) if (rows["severity"] == i).any()]
    width = max(len(s) for _, s in present)
    counts = {i: int((rows["severity"] == i).sum()) for i, _ in present}
    num = max(len(f"{n:,}") for n in counts.values())
    out = []
    for i, status in present:
        line = f"{MARKS[status]} {status:<{width}}  {counts[i]:>{num},}"
        if lay.located:
            on = set(rows.loc[rows["severity"] == i, "rank"])
            ranks = [r for r in lay.ranks if r in on]
            line += f" on {plural(len(ranks), 'rank')}" + ("" if status == "match" else f": {listing(ranks)}")
        out.append(line)
    return out


def layer_rank_text(
    verdicts: pd.DataFrame, *, max_ranks: int | None = None, keep: Sequence[bool] | pd.Series | None = None
) -> str:
    """The worst status per (model part, rank) as a terminal grid, a legend and per-status totals.

    One line per model part (``embed``, ``layer N``, ``norm``, ``head``,
    ``other``), one column per rank in identity order; a header line per rank
    coordinate; each cell one mark of :data:`MARKS` (``-`` where the rank holds
    nothing of that part). With ``max_ranks``, only that many ranks are drawn:
    the ones with the worst findings first; a line says how many are left out.
    Totals count every row of the frame, drawn or not. ``keep``: one flag per row, what
    a filter keeps (as :func:`wcviz.views.plot_layer_rank`'s): a cell shows the worst of
    its kept rows (``/`` where a filter left out all of them), the totals count the kept
    rows, and a last line counts what was left out, so no filter hides a finding.
    """
    lay = grid_of(verdicts)
    if not lay.parts:
        return "no verdicts"
    held = worst_severity(lay)
    mask = None if keep is None else keep_mask(keep, lay.n_rows)
    worst = held if mask is None else worst_severity(lay, mask)
    shown = _pick(held, max_ranks)
    header, cell = _header(lay, shown)
    label = max(len(t) for t in [*lay.parts, *(h for h, _ in header)])

    def line(name: str, cells: list[str]) -> str:
        return (name.ljust(label) + "  " + " ".join(c.ljust(cell) for c in cells)).rstrip()

    grid = worst[shown]
    out = [line(name, values) for name, values in header]
    for part, row in grid.iterrows():
        had = held.loc[part, shown]
        out.append(line(str(part), [(NOT_HELD if pd.isna(h) else FILTERED) if pd.isna(s) else MARKS[SEVERITY[int(s)]] for s, h in zip(row, had)]))
    drawn = {int(s) for s in grid.stack().dropna()}
    legend = [f"{MARKS[s]} {s}" for i, s in enumerate(SEVERITY) if i in drawn]
    if held[shown].isna().any().any():
        legend.append(f"{NOT_HELD} not held")
    if (grid.isna() & held[shown].notna()).any().any():
        legend.append(f"{FILTERED} filtered out")
    out.append("legend: " + "  ".join(legend))
    numbers = _url_numbers(lay)
    if any(r in numbers for r in shown):
        out.append("; ".join(f"url {numbers[r]} {r}" for r in shown if r in numbers))
    hidden = [r for r in lay.ranks if r not in set(shown)]
    if hidden:  # what the hidden ranks hold, filtered or not: a filter never makes a left-out rank read "all match"
        bad = int((held[hidden].min() < SEVERITY.index("match")).sum())
        out.append(f"{len(hidden)} of {plural(len(lay.ranks), 'rank')} not shown ({f'{bad} with findings' if bad else 'all match'})")
    if mask is None:
        out.extend(_totals(lay))
        return "\n".join(out)
    kept = dataclasses.replace(lay, cells=lay.cells[mask[lay.cells["row"].to_numpy()]])
    if len(kept.cells):
        out.extend(_totals(kept))
    cut = verdicts["status"][~mask].astype("object").value_counts()
    left = ", ".join(f"{int(cut[s]):,} {s}" for s in SEVERITY if s in cut)
    out.append(f"filtered: {int(mask.sum()):,} of {plural(len(verdicts), 'verdict')} shown" + (f"; left out: {left}" if left else ""))
    return "\n".join(out)


def status_counts_text(verdicts: pd.DataFrame) -> str:
    """One line: ranks, verdicts, then each status that occurs, worst first, with how many ranks it is on.

    ``4 ranks, 24 verdicts: 3 unwritten on 1 rank, 21 match`` (the counts of
    :func:`wcviz.verdicts.status_parts`, without naming the ranks).
    """
    lay = grid_of(verdicts)
    parts = status_parts(verdicts, name_ranks=False)
    head = (f"{plural(len(lay.ranks), 'rank')}, " if lay.located else "") + plural(len(verdicts), "verdict")
    return f"{head}: {', '.join(parts) or 'nothing to check'}"