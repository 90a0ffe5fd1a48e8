"""Plot fraction-of-floor vs M per strategy from bench_input_proj.py's results.json.

    python -m dsv4.bench.plot_input_proj RESULTS_DIR   (writes fraction_of_floor.png beside it)
"""

from __future__ import annotations

import json
import os
import sys

from dsv4.bench.args import pyplot


def plot(res: dict, out_dir: str, mode: str = "graph") -> str | None:
    """Write the PNG of one mode; its path, or None (said on stderr) without matplotlib."""
    path = os.path.join(out_dir, f"fraction_of_floor{'' if mode == 'graph' else '_' + mode}.png")
    plt = pyplot("input-proj", path)
    if plt is None:
        return None

    rows = [r for r in res["rows"] if r.get("mode") == mode and r.get("us")
            and r["layer_type"] in ("C4", "C128", "SWA")]
    models = sorted({r["model"] for r in rows}, key=lambda m: ("flash", "pro").index(m))
    layers = [lt for lt in ("C4", "C128", "SWA") if any(r["layer_type"] == lt for r in rows)]
    fig, axes = plt.subplots(len(models), len(layers), figsize=(5.2 * len(layers),
                                                                  4.0 * len(models)),
                             squeeze=False, sharey=True)
    series = sorted({(r["strategy"], r["weights_dtype"]) for r in rows})
    for i, model in enumerate(models):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            for strat, wdt in series:
                pts = sorted((r["M"], r["fraction"]) for r in rows if r["model"] == model
                             and r["layer_type"] == layer and r["strategy"] == strat
                             and r["weights_dtype"] == wdt)
                if not pts:
                    continue
                style = "--" if wdt != "bf16" else "-"
                lw = 2.2 if strat.startswith("fused4_dsv4") else 1.2
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                        lw=lw, label=f"{strat} ({wdt})")
            ax.axhline(0.9, color="grey", lw=0.6, ls=":")
            ax.axhline(0.8, color="grey", lw=0.6, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{model} {layer} ({mode})")
            ax.set_xlabel("M (tokens)")
            if j == 0:
                ax.set_ylabel("fraction of memory floor")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{res.get('gpu', '')}: copy bw {res.get('copy_bw_TBps', 0):.2f} TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit(__doc__)
    d = argv[0]
    with open(os.path.join(d, "results.json")) as f:
        res = json.load(f)
    for mode in ("graph", "eager"):
        print(plot(res, d, mode))


if __name__ == "__main__":
    main()
