"""What the dashboard's filters leave of the verdicts: the role, the status, a parameter search, the drill-down's choice.

Plain Python over the frames a :class:`wcviz.widgets.DashboardState` holds (its
``verdicts``, ``frames``, ``current``): the table view's rows, the rows the heatmap
keeps, the parameters the drill-down offers and each view's text form.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import pandas as pd

from wcviz.frame import IDENTITY, rank_ids
from wcviz.verdicts import SEVERITY

__all__ = ["ALL", "NOT_MATCH", "VerdictFilters"]

ALL = "all"
NOT_MATCH = "not match"


class VerdictFilters:
    """The filters and what they leave; mixed into :class:`wcviz.widgets.DashboardState`, whose frames it reads."""

    verdicts: pd.DataFrame | None
    frames: dict[str, pd.DataFrame]
    current: pd.DataFrame | None
    role_filter: str
    status_filter: str
    search: str
    drill_choice: str | None

    def empty_hint(self) -> str:
        """Why there is nothing to show (defined by DashboardState, which knows the flow's step)."""
        raise NotImplementedError(f"{type(self).__name__} must define empty_hint(): VerdictFilters is a mixin of DashboardState")

    def roles(self, v: pd.DataFrame) -> pd.Series:
        """The role of each verdict row: its own column; else the actual side's (a ``missing`` row takes the role
        its rank has in its other rows, never the expected side's, a checkpoint's); else the role its rank has in
        the frames. NA where no one says (a rank that never answered): the role filter keeps those rows."""
        if "role" in v:
            return v["role"].astype("string")
        if "role_actual" in v:
            own = v["role_actual"].astype("string")
            if not own.isna().any():
                return own
            ids = rank_ids(v)
            key = pd.Series([tuple(r) for r in ids.astype("object").where(ids.notna(), None).itertuples(index=False)], index=v.index)
            by_rank = own.groupby(key, dropna=False).transform(lambda r: r.dropna().iloc[0] if r.notna().any() else pd.NA)
            return own.fillna(by_rank.astype("string"))
        known = [f for f in [*self.frames.values(), self.current] if f is not None and "role" in f and len(f)]
        cols = [c for c in IDENTITY if c in v]
        if not known or not cols:
            return pd.Series(pd.NA, index=v.index, dtype="string")
        pairs = pd.concat([f[cols + ["role"]] for f in known]).drop_duplicates(cols)
        merged = v[cols].merge(pairs, on=cols, how="left")["role"]
        return pd.Series(merged.to_numpy(), index=v.index, dtype="string")

    def role_options(self) -> list[tuple[str, str]]:
        v = self.verdicts
        roles: list[str] = []
        if v is not None:
            roles = sorted(str(r) for r in self.roles(v).dropna().unique())
        elif self.current is not None and "role" in self.current:
            roles = sorted(str(r) for r in self.current["role"].dropna().unique())
        return [(ALL, ALL)] + [(r, r) for r in roles]

    def status_options(self) -> list[tuple[str, str]]:
        v = self.verdicts
        opts = [(ALL, ALL)]
        if v is not None:
            counts = v["status"].astype("object").value_counts()
            opts.append((f"{NOT_MATCH} ({int(len(v) - counts.get('match', 0)):,})", NOT_MATCH))
            opts += [(f"{s} ({int(counts[s]):,})", s) for s in SEVERITY if s in counts]
        return opts

    def role_rows(self) -> pd.DataFrame | None:
        """The verdicts of the chosen role, and every row whose role no one says (a rank that never answered):
        the filter narrows to a role, it never hides a rank that could not say what it is."""
        v = self.verdicts
        if v is None or self.role_filter == ALL:
            return v
        return v[(self.roles(v) == self.role_filter).fillna(True).to_numpy()].reset_index(drop=True)

    def set_search(self, text: str) -> None:
        """The parameter filter: a regular expression searched in each name; an invalid one raises and changes nothing."""
        text = str(text).strip()
        if text:
            try:
                re.compile(text)
            except re.error as e:
                raise ValueError(f"the parameter filter {text!r} is not a regular expression: {e}") from None
        self.search = text

    def keep(self, v: pd.DataFrame) -> pd.Series:
        """Which rows of ``v`` the status filter and the parameter search keep (the plots grey out the rest)."""
        hit = pd.Series(True, index=v.index)
        if self.status_filter == NOT_MATCH:
            hit &= (v["status"] != "match").to_numpy()
        elif self.status_filter != ALL:
            hit &= (v["status"] == self.status_filter).to_numpy()
        text = self.search.strip()
        if text:
            pattern = re.compile(text)  # checked by set_search
            hit &= v["name"].map(lambda n: not pd.isna(n) and bool(pattern.search(str(n)))).astype(bool).to_numpy()
        return hit.astype(bool)

    @property
    def filtering(self) -> bool:
        """Whether the status filter or the parameter search narrows the verdicts."""
        return self.status_filter != ALL or bool(self.search.strip())

    @property
    def table(self) -> pd.DataFrame | None:
        """The verdict rows the table view shows: role, status filter and parameter search applied."""
        v = self.role_rows()
        if v is None:
            return None
        return v[self.keep(v).to_numpy()].reset_index(drop=True)

    @property
    def drill_names(self) -> list[str]:
        """The parameters the drill-down can show: the named rows of :attr:`table`, worst first, each once."""
        t = self.table
        return [] if t is None else list(dict.fromkeys(str(n) for n in t["name"].dropna()))

    @property
    def drilldown_name(self) -> str | None:
        """The parameter the drill-down shows: the one chosen (:attr:`drill_choice`) while the filters keep it, else the first."""
        names = self.drill_names
        if not names:
            return None
        return self.drill_choice if self.drill_choice in names else names[0]

    def drill_frames(self) -> Mapping[str, pd.DataFrame]:
        """Digest frames per phase for the drill-down: the frames, else the verdicts' ``digest_<phase>`` columns.

        The drill-down judges them with :attr:`verdicts` (an ``unproven`` verdict, an actual
        digest against the expected one of the same rank).
        """
        v = self.verdicts
        paired = v is not None and {"digest_expected", "digest_actual"} <= set(v.columns)
        if self.frames and not (paired and set(self.frames) == {"expected", "actual"}):
            return self.frames  # expected against actual: the verdicts hold the expected digest of every rank
        assert v is not None
        phases = [c.removeprefix("digest_") for c in v.columns if c.startswith("digest_")]
        if not phases:
            raise ValueError("the drill-down needs digests: this verdict frame has no digest_<phase> columns")
        cols = [c for c in IDENTITY if c in v] + ["name"] + [c for c in ("algo",) if c in v]
        return {p: v[cols + [f"digest_{p}"]].rename(columns={f"digest_{p}": "digest"}).dropna(subset=["digest"]) for p in phases}

    def view_text(self, view: str) -> str:
        """The text form of ``view`` (what the picture shows, for logs and notebook checks)."""
        from wcviz.views import drilldown_text, layer_rank_text, topology_text

        v = self.role_rows()
        if v is None:
            return self.empty_hint()
        if view == "layer × rank":  # as the picture: what the status and parameter filters leave, the rest accounted for
            return layer_rank_text(v, keep=self.keep(v) if self.filtering else None)
        if view == "topology":
            note = "the status and parameter filters do not apply here: the topology shows each rank's worst status\n"
            return (note if self.filtering else "") + str(topology_text(v))
        if view == "drill-down":
            name = self.drilldown_name
            if name is None:
                return "no parameter matches the filters"
            return str(drilldown_text(self.drill_frames(), name, verdicts=self.verdicts))
        t = self.table
        assert t is not None
        ids = [c for c in (*IDENTITY, "url") if c in t and t[c].notna().any()]  # every coordinate that tells ranks apart
        cols = ids + [c for c in ("name", "status") if c in t]
        return t[cols].to_string(index=False) if len(t) else "no verdicts match the filters"
