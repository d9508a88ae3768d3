"""A picture of a local run: loss and tokens/s against step and against wall time, every switch
and recovery marked with its reason, layouts and pause, and the run's summary beside them.

``dynatrain run --report DIR`` draws it when the run ends and ``dynatrain report SUMMARY.json``
draws it again from a saved summary; both read only the summary (:meth:`.local.RunResult.summary`),
so the picture is exactly what ``--summary-json`` holds. What goes on it is decided by pure
functions (:func:`marks`, :func:`steps_of`, :func:`summary_lines`) that tests check as text;
:func:`render` only draws that. matplotlib is imported inside :func:`render`, on its Agg
backend, so importing this module opens no display and costs the runner nothing when it does
not draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

REASON_COLOURS = {"preemption": "#d62728", "scale-down": "#ff7f0e", "release": "#e377c2",
                  "scale-up": "#2ca02c",
                  "better-layout": "#17becf", "rebalance": "#bcbd22", "requested": "#9467bd"}
"""One colour per switch reason (``agent.metrics.REASONS``); any other reason is brown."""
OTHER_COLOUR = "#8c564b"
RECOVERY_COLOUR = "#000000"
LOSS_COLOUR = "#1f3b73"
TPS_COLOUR = "#4d4d4d"
TABLE_ROWS = 8
"""Marks listed in the side panel before "... and N more" (the JSON has them all)."""
LABEL_TRIES = 4
"""Times a mark's label moves down, under the labels it would overlap, before it stays where
it is; the top third of every plot is kept free of the curve for them (:func:`_headroom`)."""
LABEL_MARKS = 8
"""Up to this many marks are labelled in full on the plots; more get their number only, or the
labels would cover the curves (the side panel has the details by number)."""


class ReportError(ValueError):
    """The summary cannot be drawn (not a run summary, or a field of the wrong kind); the
    message names the field."""


@dataclass(frozen=True, kw_only=True)
class Mark:
    """One switch or recovery as the picture shows it: a vertical line at its step, and at its
    time where that is known, with a short label."""

    number: int
    """1, 2, ... in step order: ties a line on the plots to its row in the side panel."""
    kind: str
    """``switch`` or ``recovery``."""
    reason: str
    step: int
    time: float | None
    from_layout: str
    to_layout: str
    pause_seconds: float
    bytes: int
    result: str = "success"
    lost_steps: int = 0
    """Steps trained again after a recovery went back to ``step``."""
    from_checkpoint: bool = False
    recovery_seconds: float = 0.0

    @property
    def colour(self) -> str:
        if self.kind == "recovery":
            return RECOVERY_COLOUR
        return REASON_COLOURS.get(self.reason, OTHER_COLOUR)

    @property
    def label(self) -> str:
        """Two short lines for the plots: what and how long it paused, then from -> to."""
        what = f"#{self.number} {'recovery' if self.kind == 'recovery' else self.reason}"
        if self.result != "success":
            what += f" ({self.result})"
        moved = f"{short_layout(self.from_layout)}→{short_layout(self.to_layout)}"
        if self.kind == "recovery":
            return (f"{what}, {_duration(self.recovery_seconds)}\n{moved}, "
                    f"{_count(self.lost_steps, 'step', 'steps')} again")
        return f"{what}, {_duration(self.pause_seconds)}\n{moved}"


def short_layout(text: str) -> str:
    """``dp=4,tp=1,pp=1`` -> ``dp=4``: axes of degree 1 dropped, the rest (zero, stages,
    order) kept, so a label stays a few characters wide; the side panel has the full text."""
    kept = [item for item in text.split(",")
            if item.partition("=")[0] not in ("dp", "tp", "pp", "ep")
            or item.partition("=")[2] != "1"]
    return ",".join(kept) or (text.split(",")[0] if text else "?")


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _number(summary: dict, key: str):
    value = summary.get(key)
    if value is not None and not isinstance(value, (int, float)):
        raise ReportError(f"summary field {key!r}={value!r} is not a number")
    return value


def marks(summary: dict) -> list[Mark]:
    """The switches and recoveries to draw, in step order. A switch entry without ``from`` is
    the job's start, not a switch (the runner reports it as "started"), and is left out."""
    found = []
    for kind, key in (("switch", "switches"), ("recovery", "recoveries")):
        for i, entry in enumerate(summary.get(key) or ()):
            if not isinstance(entry, dict) or "step" not in entry:
                raise ReportError(f"summary field {key}[{i}]={entry!r} is not a switch record "
                                  "with a step")
            if kind == "switch" and not entry.get("from"):
                continue
            phases = entry.get("phases") or {}
            try:
                found.append(dict(
                    kind=kind, reason=str(entry.get("reason") or kind), step=int(entry["step"]),
                    time=_finite(entry.get("time")), from_layout=str(entry.get("from") or "?"),
                    to_layout=str(entry.get("to") or "?"),
                    pause_seconds=float(entry.get("pause_seconds") or 0.0),
                    bytes=int(entry.get("bytes") or 0),
                    result=str(entry.get("result") or "success"),
                    lost_steps=int(phases.get("lost_steps") or 0),
                    from_checkpoint=bool(phases.get("from_checkpoint")),
                    recovery_seconds=float(phases.get("recovery_seconds") or 0.0)))
            except (TypeError, ValueError, AttributeError) as e:
                raise ReportError(f"summary field {key}[{i}]={entry!r}: {e}") from None
    # A recovery and a switch at one step: by time when both are known, the recovery first
    # (it is what made the layout change), so the numbers read in the order things happened.
    found.sort(key=lambda m: (m["step"], m["time"] if m["time"] is not None else math.inf,
                              m["kind"] != "recovery"))
    return [Mark(number=n, **m) for n, m in enumerate(found, 1)]


def steps_of(summary: dict) -> list[dict]:
    """One point per step, in step order: ``step``, ``loss``, ``tokens_per_second`` and
    ``time`` (None where unknown). A step listed twice (trained again after a recovery) keeps
    its last entry, as the run's own step log does. A summary without ``step_log`` (written
    before it existed) gives its losses, counted back from its last step, without times."""
    log = summary.get("step_log")
    if log is None:
        losses = summary.get("losses") or []
        last = int(summary.get("steps") or len(losses))
        log = [{"step": last - len(losses) + 1 + i, "loss": loss, "tokens_per_second": None,
                "time": None} for i, loss in enumerate(losses)]
    by_step: dict[int, dict] = {}
    for i, entry in enumerate(log):
        if not isinstance(entry, dict) or "step" not in entry:
            raise ReportError(f"summary field step_log[{i}]={entry!r} has no step")
        try:
            by_step[int(entry["step"])] = {
                "step": int(entry["step"]), "loss": _finite(entry.get("loss")),
                "tokens_per_second": _finite(entry.get("tokens_per_second")),
                "time": _finite(entry.get("time"))}
        except (TypeError, ValueError) as e:
            raise ReportError(f"summary field step_log[{i}]={entry!r}: {e}") from None
    return [by_step[s] for s in sorted(by_step)]


def _finite(value) -> float | None:
    # None (unknown) and NaN or inf (a diverged loss, say) are both left off the plot: the
    # curve joins the points either side, and an unknown time is counted in the side panel.
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def summary_blocks(summary: dict) -> list[tuple[str, list[str]]]:
    """The side panel as (style, lines) blocks, top to bottom: the run in numbers (``head``),
    the data audit's verdict (``ok`` or ``bad``), then every switch and recovery by number
    with its full layouts and the layout requests (``table``)."""
    steps = steps_of(summary)
    found = marks(summary)
    wall = _number(summary, "wall_seconds")
    final = _number(summary, "final_loss")
    head = [f"{summary.get('steps', len(steps))} steps"
            + (f" in {wall:.1f} s" if wall is not None else ""),
            "final loss " + (f"{final:.4f}" if final is not None and math.isfinite(final)
                             else "unknown")]
    rates = sorted(s["tokens_per_second"] for s in steps if s["tokens_per_second"])
    if rates:
        head.append(f"median {rates[len(rates) // 2]:,.0f} tokens/s")
    untimed = sum(1 for s in steps if s["time"] is None)
    if untimed:
        head.append(f"{untimed} step(s) without a time (left off")
        head.append("  the wall-time plots)")
    consumed = summary.get("samples_consumed")
    once = bool(summary.get("samples_exactly_once"))
    audit = [f"data: {consumed} samples," if consumed is not None else "data:",
             "  each exactly once" if once else "  NOT exactly once"]

    switches = [m for m in found if m.kind == "switch"]
    recoveries = [m for m in found if m.kind == "recovery"]
    table = [f"{_count(len(switches), 'switch', 'switches')}, "
             f"{_duration(sum(m.pause_seconds for m in switches))} paused in all"
             if switches else "no switches"]
    if recoveries:
        table.append(f"{_count(len(recoveries), 'recovery', 'recoveries')} from failures")
    if found:
        table.append("")
        table.append("  #  step  reason         pause     MiB")
    for m in found[:TABLE_ROWS]:
        if m.kind == "recovery":
            where = "checkpoint" if m.from_checkpoint else "memory"
            table.append(f"{m.number:>3} {m.step:>5}  {'recovery':<13} "
                         f"{_duration(m.recovery_seconds):>7}  {m.bytes / 2**20:6.2f}")
            table.append(f"      from {where}, {m.lost_steps} step(s) again")
        else:
            table.append(f"{m.number:>3} {m.step:>5}  {m.reason:<13} "
                         f"{_duration(m.pause_seconds):>7}  {m.bytes / 2**20:6.2f}")
        table.append(f"      {m.from_layout}")
        table.append(f"    → {m.to_layout}"
                     + (f"  ({m.result})" if m.result != "success" else ""))
    if len(found) > TABLE_ROWS:
        table.append(f"  ... and {len(found) - TABLE_ROWS} more (in the summary JSON)")
    requests = summary.get("requests") or []
    if requests:
        table.append("")
        for r in requests[:4]:
            table.append(f"request {r.get('layout')} (step {r.get('step')}):")
            table.append(f"  {r.get('state')}")
    return [("head", head), ("ok" if once else "bad", audit), ("table", table)]


def summary_lines(summary: dict) -> list[str]:
    """The side panel's text, one string per line."""
    return [line for _, lines in summary_blocks(summary) for line in lines]


def report_path(summary: dict, out_dir: Path | str) -> Path:
    """Where :func:`write_report` puts the picture: one file per job, so runs of several jobs
    can share a folder."""
    return Path(out_dir) / f"{summary.get('job') or 'job'}-run.png"


def render(summary: dict):
    """The figure (a :class:`matplotlib.figure.Figure`, not shown anywhere): four plots and
    the side panel. Raises :class:`ReportError` for a summary it cannot read."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.offsetbox import AnchoredOffsetbox, TextArea, VPacker
    from matplotlib.patches import Patch

    if not isinstance(summary, dict) or "job" not in summary:
        raise ReportError("not a run summary: no 'job' field (write one with "
                          "`dynatrain run JOB --summary-json FILE`)")
    steps = steps_of(summary)
    found = marks(summary)

    # 16 x 9 inches at 110 dpi: a screen's shape, legible without zooming. The Agg canvas
    # (never a display) lets the labels be measured as they are placed.
    fig = Figure(figsize=(16, 9), dpi=110)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 3, width_ratios=(1, 1, 0.72), left=0.05, right=0.985,
                            top=0.855, bottom=0.07, wspace=0.2, hspace=0.28)
    loss_step = fig.add_subplot(grid[0, 0])
    tps_step = fig.add_subplot(grid[0, 1], sharex=loss_step)
    loss_time = fig.add_subplot(grid[1, 0])
    tps_time = fig.add_subplot(grid[1, 1], sharex=loss_time)
    side = fig.add_subplot(grid[:, 2])
    side.axis("off")

    timed = sorted((s for s in steps if s["time"] is not None), key=lambda s: s["time"])
    for ax, points, x, y, colour, ylabel in (
            (loss_step, steps, "step", "loss", LOSS_COLOUR, "loss (cross-entropy)"),
            (tps_step, steps, "step", "tokens_per_second", TPS_COLOUR, "tokens/s"),
            (loss_time, timed, "time", "loss", LOSS_COLOUR, "loss (cross-entropy)"),
            (tps_time, timed, "time", "tokens_per_second", TPS_COLOUR, "tokens/s")):
        xs = [p[x] for p in points if p[y] is not None]
        ys = [p[y] for p in points if p[y] is not None]
        ax.plot(xs, ys, color=colour, lw=1.4, marker="o", ms=2.2)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("step" if x == "step" else "wall time (s since the run started)")
        ax.grid(alpha=0.3)
        if y == "tokens_per_second":
            ax.yaxis.set_major_formatter("{x:,.0f}")
        _headroom(ax, ys, zero=y == "tokens_per_second")
        if not xs:
            ax.text(0.5, 0.5, "no steps with a time" if x == "time" else "no steps",
                    transform=ax.transAxes, ha="center", va="center", color="0.4")
    loss_step.set_title("loss by step")
    tps_step.set_title("throughput by step")
    loss_time.set_title("loss over wall time")
    tps_time.set_title("throughput over wall time")
    if steps:
        first, last = steps[0]["step"], steps[-1]["step"]
        loss_step.set_xlim(first - 0.5, max(last, *(m.step for m in found), first) + 0.5)
    times = [s["time"] for s in timed] + [m.time for m in found if m.time is not None]
    if times:
        loss_time.set_xlim(0, max(times) * 1.02 or 1)

    if timed and timed[0]["time"] > 0.05 * loss_time.get_xlim()[1]:
        # The seconds before the first step ends (workers starting, the model built, the
        # first step) would otherwise read as a gap in the data.
        for ax in (loss_time, tps_time):
            ax.axvspan(0, timed[0]["time"], facecolor="0.93", lw=0)
            ax.text(timed[0]["time"] / 2, 0.03, f"start-up\n(step {timed[0]['step']} ends\n"
                    f"at {timed[0]['time']:.1f} s)", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8, color="0.35")
    for ax, axis in ((loss_step, "step"), (tps_step, "step"), (loss_time, "time"),
                     (tps_time, "time")):
        _draw_marks(ax, found, axis)

    # One legend for all four plots, under the title, so no plot loses room to it.
    handles = [Line2D([], [], color=LOSS_COLOUR, marker="o", ms=3, label="loss"),
               Line2D([], [], color=TPS_COLOUR, marker="o", ms=3, label="tokens/s")]
    for reason in dict.fromkeys(m.reason for m in found if m.kind == "switch"):
        handles.append(Line2D([], [], color=REASON_COLOURS.get(reason, OTHER_COLOUR), lw=2,
                              label=f"switch: {reason}"))
    if any(m.kind == "recovery" for m in found):
        handles.append(Line2D([], [], color=RECOVERY_COLOUR, lw=2, ls="--",
                              label="recovery from a failure"))
    if any(m.lost_steps for m in found):
        handles.append(Patch(facecolor="0.6", alpha=0.3, hatch="//",
                             label="steps trained again"))
    rows = math.ceil(len(handles) / 6)          # wider than the plots otherwise
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.38, 0.945),
               ncol=math.ceil(len(handles) / rows), frameon=False, fontsize=10)
    fig.suptitle(f"DynaTrain run: {summary['job']}", x=0.38, y=0.985, fontsize=16,
                 fontweight="bold")

    # The side panel: blocks stacked by matplotlib's packer, so each keeps its own style and
    # none overlaps the next whatever its length.
    styles = {"head": dict(fontsize=11), "table": dict(fontsize=9.5),
              "ok": dict(fontsize=11, fontweight="bold", color="#2ca02c"),
              "bad": dict(fontsize=11, fontweight="bold", color="#d62728")}
    side.set_title("summary", loc="left", fontsize=13, fontweight="bold")
    packed = VPacker(children=[
        TextArea("\n".join(block), textprops=dict(family="monospace", linespacing=1.3,
                                                  **styles[style]))
        for style, block in summary_blocks(summary)], align="left", pad=0, sep=12)
    side.add_artist(AnchoredOffsetbox(loc="upper left", child=packed, frameon=False,
                                      bbox_to_anchor=(0, 1), bbox_transform=side.transAxes,
                                      borderpad=0, pad=0))
    return fig


def _headroom(ax, ys: list[float], *, zero: bool) -> None:
    """Leave the top third of a plot to the mark labels, so they sit above the curve rather
    than on it."""
    if not ys:
        return
    low = 0.0 if zero else min(ys)
    high = max(ys)
    span = (high - low) or abs(high) or 1.0
    ax.set_ylim(low - (0 if zero else 0.05 * span), high + 0.55 * span)


def _draw_marks(ax, found: list[Mark], axis: str) -> None:
    """A vertical line per mark and its label near the top of the plot, placed where its box,
    as drawn, overlaps no label already placed: measured, not guessed, since a label's width
    depends on its text and one near the right edge grows leftwards."""
    full = len(found) <= LABEL_MARKS
    renderer = ax.figure.canvas.get_renderer()
    placed = []
    for m in found:
        x = m.step if axis == "step" else m.time
        if x is None:
            continue
        recovery = m.kind == "recovery"
        ax.axvline(x, color=m.colour, lw=1.8, ls="--" if recovery else "-", alpha=0.9)
        if recovery and m.lost_steps and axis == "step":
            ax.axvspan(m.step + 0.5, m.step + m.lost_steps + 0.5, facecolor="0.6", alpha=0.3,
                       hatch="//", edgecolor="0.45", lw=0)
        label = ax.annotate(
            m.label if full else f"#{m.number}", xy=(x, 0.975),
            xycoords=("data", "axes fraction"), xytext=(4, 0), textcoords="offset points",
            ha="left", va="top", fontsize=9, color=m.colour, linespacing=1.15,
            bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor=m.colour,
                      alpha=0.9, lw=0.8))
        if label.get_window_extent(renderer).x1 > ax.get_window_extent(renderer).x1:
            label.set_horizontalalignment("right")   # to the line's left, inside the plot
            label.xyann = (-4, 0)
        # Top of the plot, else just under the lowest label it would overlap (in pixels: the
        # boxes are padded by the round frame's width, and a 1-pixel gap keeps them apart).
        for _ in range(LABEL_TRIES):
            box = label.get_window_extent(renderer).padded(3)
            hit = [other for other in placed if box.overlaps(other)]
            if not hit:
                break
            top = ax.transAxes.transform((0, label.xy[1]))[1]
            top -= box.y1 - min(other.y0 for other in hit) + 1
            label.xy = (x, ax.transAxes.inverted().transform((0, top))[1])
        placed.append(label.get_window_extent(renderer).padded(3))


def figure_texts(fig) -> list[str]:
    """Every piece of text the figure shows (titles, labels, legend, annotations, side
    panel), for tests and for anyone who wants to check a picture without looking at it."""
    from matplotlib.text import Text

    return [t.get_text() for t in fig.findobj(Text) if t.get_text() and t.get_visible()]


def write_report(summary: dict, out_dir: Path | str) -> Path:
    """Draw the run's picture into ``<out_dir>/<job>-run.png`` (the folder is made if
    missing) and return its path."""
    fig = render(summary)
    path = report_path(summary, out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=fig.dpi, facecolor="white")
    return path
