"""effmem plan --chart: stacked bars of where each candidate's peak goes, with the memory a pick may use (the
GPU's, less the plan's headroom) as a line.

SVG is written directly (no dependency); PNG needs matplotlib.
"""
import importlib.util
import os
from pathlib import Path
from typing import List, Tuple
from xml.sax.saxutils import escape

from effmem.plan.report import size_text

# (label, parts summed, colour): the split users know from the ZeRO paper's figure.
SERIES = (("parameters", ("weights",), "#4c72b0"), ("gradients", ("grads",), "#dd8452"),
          ("optimizer state", ("master", "optimizer"), "#55a868"),
          ("activations", ("activations", "logits"), "#c44e52"),
          ("temporary + reserve", ("temporary", "reserve"), "#8c8c8c"))
CHART_ROWS = (("fp32", "none", "gpu"), ("bf16", "none", "gpu"), ("bf16", "fast", "gpu"), ("bf16", "checkpoint", "gpu"),
              ("bf16", "checkpoint8", "gpu"),
              ("bf16", "compress8", "gpu"), ("bf16", "checkpoint", "offload"), ("bf16", "compress8", "offload"))


def chart_rows(plan) -> List[Tuple[str, List[float]]]:
    """The bars: the classic progression (fp32, bf16, + checkpointing, + offload...) and the pick, in bytes.
    The progression keeps the standard loss and float32 moments, so each bar differs from the one above
    by what its name says; the pick is drawn as it is."""
    micro = plan.pick.config.micro_batch if plan.pick else None
    chosen = []
    for prec, act, opt in CHART_ROWS:
        rows = [c for c in plan.candidates if (c.config.precision, c.config.activations, c.config.optimizer,
                                               c.config.loss, c.config.state_bits) == (prec, act, opt, "standard", 32)]
        same = [c for c in rows if c.config.micro_batch == micro] or rows
        if same:
            chosen.append(min(same, key=lambda c: c.cost.peak_bytes))
    if plan.pick is not None and plan.pick not in chosen:
        chosen.append(plan.pick)
    return [(c.name + (" (pick)" if c is plan.pick else ""),
             [sum(c.cost.parts[p] for p in parts) for _, parts, _ in SERIES]) for c in chosen]


def check_output(path: str, what: str) -> Path:
    """A file the command will write, refused before any work (planning, --verify's training, the demo's
    runs): an empty path, a folder, a folder that does not exist, one it may not write in."""
    if not path:
        raise ValueError(f"{what}: expected a file path, got an empty one")
    out = Path(path)
    folder = out.resolve().parent
    if out.is_dir():
        raise ValueError(f"{what}: {path!r} is a folder; give a file name in it")
    if not folder.is_dir():
        raise ValueError(f"{what}: the folder of {path!r} does not exist")
    if not os.access(out if out.exists() else folder, os.W_OK):
        raise ValueError(f"{what}: {path!r} cannot be written (permission denied)")
    return out


def check_path(path: str) -> Path:
    """A chart's path: .svg or .png, one the command can write (checked before planning)."""
    out = check_output(path, "chart")
    if out.suffix.lower() not in (".svg", ".png"):
        raise ValueError(f"chart: expected a path ending in .svg or .png, got {path!r}")
    if out.suffix.lower() == ".png" and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"chart: {path!r}: a .png needs matplotlib (pip install matplotlib); a .svg needs nothing")
    return out


def write_chart(plan, path: str) -> str:
    out = check_path(path)
    rows = chart_rows(plan)
    if not rows:
        raise ValueError("chart: the plan has no candidates to draw")
    if out.suffix.lower() == ".png":
        return _png(plan, rows, out)
    out.write_text(_svg(plan, rows))
    return str(out)


def _axis(plan, rows) -> Tuple[str, float, float, str, bool]:
    """(unit, bytes per unit, the axis' end in units, the budget's label, whether the budget line is drawn).
    The axis fits the bars, and the memory budget where it is within twice the tallest: scaled to a 25 GB
    budget, a small model's bars were 0 pixels wide and each total read 0.0."""
    tallest = max(sum(v) for _, v in rows)
    unit, per = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if tallest >= s), ("B", 1.0))
    # the line where a bar fits, as the plan judges it: the memory less its headroom (a bar between the two
    # was drawn inside a line at the whole memory while the plan said it did not fit)
    budget = plan.usable_memory
    drawn = budget <= 2 * tallest
    where = "GPU memory" if plan.device == "cuda" else "memory budget"
    label = (f"{where} {size_text(plan.gpu_memory)} less {plan.headroom:.0%} headroom: {size_text(budget)}"
             + ("" if drawn else " (off this scale)"))
    return unit, per, max(tallest, budget if drawn else 0) * 1.05 / per, label, drawn


def _title(plan, unit: str) -> str:
    each = "per GPU" if plan.device == "cuda" else "on the CPU"
    return f"{plan.model}: predicted peak {each}, batch {plan.batch} x {plan.seq} ({unit}" + (
        f" = {dict(GB='1e9', MB='1e6', kB='1e3')[unit]} bytes)" if unit != "B" else ")")


def _svg(plan, rows) -> str:
    width, bar_h, gap, left, top = 900, 26, 12, 330, 50
    unit, per, top_units, label, drawn = _axis(plan, rows)
    scale = (width - left - 30) / top_units
    height = top + len(rows) * (bar_h + gap) + 70
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
          f'font-size="12">', f'<text x="10" y="22" font-size="15">{escape(_title(plan, unit))}</text>']
    for i, (name, values) in enumerate(rows):
        y = top + i * (bar_h + gap)
        el.append(f'<text x="{left - 8}" y="{y + bar_h * 0.7:.0f}" text-anchor="end">{escape(name)}</text>')
        x = left
        for (series, _, colour), v in zip(SERIES, values):
            w = v / per * scale
            el.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}">'
                      f'<title>{escape(series)}: {escape(size_text(v, 2))}</title></rect>')
            x += w
        el.append(f'<text x="{x + 5:.1f}" y="{y + bar_h * 0.7:.0f}">{sum(values) / per:.3g}</text>')
    y_end = top + len(rows) * (bar_h + gap)
    if drawn:
        bx = left + plan.usable_memory / per * scale
        el.append(f'<line x1="{bx:.1f}" y1="{top - 8}" x2="{bx:.1f}" y2="{y_end}" stroke="black" '
                  f'stroke-dasharray="4,3"/><text x="{bx + 4:.1f}" y="{top - 10}">{escape(label)}</text>')
    else:
        el.append(f'<text x="{left}" y="{top - 10}">{escape(label)}</text>')
    for j, (series, _, colour) in enumerate(SERIES):
        lx = left + j * 115
        el.append(f'<rect x="{lx}" y="{y_end + 20}" width="12" height="12" fill="{colour}"/>'
                  f'<text x="{lx + 16}" y="{y_end + 30}">{escape(series)}</text>')
    el.append("</svg>")
    return "\n".join(el) + "\n"


def _png(plan, rows, out: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("chart: a .png needs matplotlib (pip install matplotlib); a .svg needs nothing") from None
    unit, per, top_units, label, drawn = _axis(plan, rows)
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5))
    names = [n for n, _ in rows]
    left = [0.0] * len(rows)
    for k, (series, _, colour) in enumerate(SERIES):
        vals = [v[k] / per for _, v in rows]
        ax.barh(names, vals, left=left, color=colour, label=series)
        left = [a + b for a, b in zip(left, vals)]
    if drawn:
        ax.axvline(plan.usable_memory / per, color="black", linestyle="--", label=label)
    ax.set_xlim(0, top_units)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(_title(plan, unit) + ("" if drawn else f"; {label}"))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)
