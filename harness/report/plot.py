"""`harness plot`: the report's charts as PNG and SVG files (matplotlib), for papers and slides."""

from __future__ import annotations

from pathlib import Path

from harness.report.charts import Charts

#: figure formats; "csv" alone writes the numbers without drawing (for plotting elsewhere)
FORMATS = ("png", "svg", "csv")


def _figure(rows: int):
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt, plt.subplots(figsize=(7.5, max(2.4, 0.9 + 0.32 * rows)), layout="constrained")


def identical(ch: Charts):
    plt, (fig, ax) = _figure(len(ch.identical))
    labels = [f"{r.series} · batch {r.batch_size}" for r in ch.identical.itertuples()][::-1]
    shares = list(ch.identical["share"])[::-1]
    counts = [f"{r.identical}/{r.compared}" for r in ch.identical.itertuples()][::-1]
    ax.barh(labels, [1.0] * len(labels), color="#f1d2cf")
    bars = ax.barh(labels, shares, color="#3451b2")
    ax.bar_label(bars, counts, padding=4)
    ax.set_xlim(0, 1.15)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_xlabel(f"runs identical to the reference ({ch.reference})")
    ax.set_title("Runs identical to the reference")
    return plt, fig


def divergence(ch: Charts):
    plt, (fig, ax) = _figure(6)
    for (name, batch), part in ch.divergence.groupby(["series", "batch_size"]):
        ax.hist(part["first_divergence"], bins=min(24, int(part["first_divergence"].max()) + 1), alpha=0.75,
                label=f"{name} · batch {batch}")
    ax.set_xlabel("token position of the first difference")
    ax.set_ylabel("runs")
    ax.set_title(f"Where runs first depart ({len(ch.divergence)} runs)")
    ax.legend(fontsize="small")
    return plt, fig


def margins(ch: Charts):
    plt, (fig, ax) = _figure(8)
    pts = ch.margins.dropna(subset=["margin_run", "margin_reference"])
    top = float(max(pts["margin_run"].max(), pts["margin_reference"].max())) * 1.1 or 1.0
    ax.plot([0, top], [0, top], ls="--", color="#bbbbbb", lw=1)
    for (name, batch), part in pts.groupby(["series", "batch_size"]):
        ax.scatter(part["margin_reference"], part["margin_run"], label=f"{name} · batch {batch}", alpha=0.75)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("top-1 minus top-2 logit margin in the reference run")
    ax.set_ylabel("margin in the departing run")
    ax.set_title("How close the decision was where runs split")
    ax.legend(fontsize="small")
    return plt, fig


def slowdown(ch: Charts):
    s = ch.slowdown
    plt, (fig, ax) = _figure(len(s))
    labels = [f"{r.series} · batch {r.batch_size}" for r in s.itertuples()]
    ratio = s["throughput_ratio"]
    err = [ratio - s["throughput_ratio_min"], s["throughput_ratio_max"] - ratio]
    bars = ax.barh(labels, ratio, xerr=err, color="#9333ea", alpha=0.8, capsize=3)
    ax.bar_label(bars, [f"×{v:.2f}" for v in ratio], padding=6)
    ax.axvline(1.0, color="#b3261e", ls="--", lw=1)
    ax.set_xlabel("throughput, batch-invariant off ÷ on (range over paired batches)")
    ax.set_title("What batch-invariant mode costs")
    return plt, fig


def answers(ch: Charts):
    a = ch.answers.dropna(subset=["accuracy"])
    plt, (fig, ax) = _figure(len(a))
    labels = [f"{r.series} · batch {r.batch_size}" for r in a.itertuples()][::-1]
    acc = a["accuracy"].to_numpy()[::-1]
    err = [acc - a["accuracy_low"].to_numpy()[::-1], a["accuracy_high"].to_numpy()[::-1] - acc]
    bars = ax.barh(labels, acc, xerr=err, color="#0f766e", alpha=0.85, capsize=3)
    ax.bar_label(bars, [f"{v:.1%}" for v in acc], padding=8)
    ax.set_xlim(0, 1.1)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_xlabel("accuracy (mean over prompts; bootstrap 95% interval over prompts)")
    ax.set_title("Accuracy per setting")
    return plt, fig


def survival(ch: Charts):
    """One step curve per setting with its pointwise 95 % band: the share still identical after t tokens."""
    plt, (fig, ax) = _figure(8)
    for i, ((name, batch), part) in enumerate(ch.survival.groupby(["series", "batch_size"], sort=True)):
        color = f"C{i % 10}"
        ax.step(part["tokens"], part["identical"], where="post", color=color, label=f"{name} · batch {batch}")
        ax.fill_between(part["tokens"], part["low"], part["high"], step="post", color=color, alpha=0.15)
    ax.set_ylim(0, 1.02)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("runs still identical to the reference")
    ax.set_title(f"Survival of agreement (Kaplan-Meier, 95% band; reference {ch.reference})")
    ax.legend(fontsize="small")
    return plt, fig


def flips_by_margin(ch: Charts):
    """Per setting, the chance per step that a run departs, by its reference's top-2 margin at that step."""
    data = ch.flips_by_margin.dropna(subset=["flip_rate"])
    plt, (fig, ax) = _figure(8)
    buckets = list(dict.fromkeys(ch.flips_by_margin["bucket"]))
    for i, ((name, batch), part) in enumerate(data.groupby(["series", "batch_size"], sort=True)):
        x = [buckets.index(b) for b in part["bucket"]]
        ax.plot(x, part["flip_rate"], marker="o", color=f"C{i % 10}", label=f"{name} · batch {batch}")
    ax.set_xticks(range(len(buckets)), buckets)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.1%}")
    ax.set_xlabel("top-1 minus top-2 margin of the reference at the step")
    ax.set_ylabel("runs departing there, per step at risk")
    ax.set_title("Where runs split, by how close the call was")
    ax.legend(fontsize="small")
    return plt, fig


#: split nodes drawn at most (the ones with the most runs); the CSV beside the figure has them all
SPLITS_DRAWN = 16


def splits(ch: Charts):
    """Each split (setting, prompt, token index) as one bar of its branches' runs, labelled with their tokens."""
    tree = ch.splits
    nodes = (tree.groupby(["cell_id", "prompt_id", "node"], sort=False)
             .agg(series=("series", "first"), split_at=("split_at", "first"), depth=("depth", "first"),
                  runs=("runs", "sum")).reset_index()
             .sort_values(["runs", "depth"], ascending=[False, True], kind="stable").head(SPLITS_DRAWN))
    plt, (fig, ax) = _figure(len(nodes))
    labels = []
    for y, node in enumerate(nodes.itertuples()):
        branches = tree[(tree.cell_id == node.cell_id) & (tree.prompt_id == node.prompt_id) & (tree.node == node.node)]
        left = 0
        for b in branches.itertuples():
            ax.barh(y, b.runs, left=left, color=f"C{b.branch % 10}", edgecolor="white")
            token = repr(str(b.token_text))[1:-1][:14]
            ax.text(left + b.runs / 2, y, f"{token} ({b.runs})", ha="center", va="center", fontsize="x-small",
                    color="white" if b.runs / node.runs > 0.2 else "black", clip_on=True)
            left += b.runs
        labels.append(f"{node.series} · {node.prompt_id} · token {node.split_at}" + (" (nested)" if node.depth else ""))
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("runs taking each branch")
    ax.set_title("Where the outputs split")
    return plt, fig


#: chart name (also the Charts field it draws) -> drawing function
def located(ch: Charts):
    """How a traced pass's difference from its reference grows, module by module (harness locate)."""
    plt, (fig, ax) = _figure(8)
    for (setting, prompt, kind, step), part in ch.located.groupby(["setting", "prompt_id", "step_kind", "step"],
                                                                  sort=False):
        values = part["max_abs_diff"].astype(float)
        ax.plot(part["order"], values.where(values > 0), marker=".", lw=1, label=f"{setting} / {prompt} {kind} {step}")
    ax.set_yscale("log")
    ax.set_xlabel("module, in the order the forward pass runs them (gaps: bitwise equal)")
    ax.set_ylabel("largest |difference| from the reference's pass")
    ax.set_title("Where traced passes differ, module by module")
    ax.legend(fontsize="small")
    return plt, fig


CHARTS = {"identical": identical, "divergence": divergence, "margins": margins, "slowdown": slowdown,
          "answers": answers, "splits": splits, "survival": survival, "flips_by_margin": flips_by_margin,
          "located": located}


def _plottable(ch: Charts, name: str):
    data = getattr(ch, name)
    if name == "margins":
        return data.dropna(subset=["margin_run", "margin_reference"])
    if name == "located" and not data.empty:
        return data[data["max_abs_diff"] > 0]  # passes bitwise equal throughout draw nothing on a log scale
    if name == "flips_by_margin" and not data.empty:
        return data[data["flips"] > 0]  # a chart of zeros says nothing: the CSV still has the steps
    return data.dropna(subset=["accuracy"]) if name == "answers" and not data.empty else data


def write(ch: Charts, out: Path, formats: tuple[str, ...] = FORMATS) -> tuple[list[Path], list[str]]:
    """Draw every chart that has data, each beside a CSV of its numbers.

    Returns the files written and the charts left out, with why. Every chart's CSV is written;
    a figure is drawn only for the image formats among `formats`.
    """
    figures = [f for f in formats if f != "csv"]
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    left_out: list[str] = []
    for name, draw in CHARTS.items():
        getattr(ch, name).to_csv(out / f"{name}.csv", index=False)
        written.append(out / f"{name}.csv")
        if _plottable(ch, name).empty:
            left_out.append(f"{name}: no data in these results")
            continue
        if not figures:
            continue
        plt, fig = draw(ch)
        for fmt in figures:
            path = out / f"{name}.{fmt}"
            fig.savefig(path, dpi=150)
            written.append(path)
        plt.close(fig)
    return written, left_out
