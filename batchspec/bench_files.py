"""What `batchspec bench --out-dir` writes: results.csv and results.json (one row per method x
batch size x gamma), PNG plots, and with --write-config the best setting per batch size as a
`batchspec run --config` file."""

import csv
import json
from pathlib import Path

from batchspec.config import as_toml
from batchspec.errors import UsageError

COLUMNS = [
    "batch_size", "method", "gamma", "tokens_per_s", "tokens_per_s_median", "spread", "seconds_per_row",
    "speedup_vs_ar", "alpha", "accepted_length", "target_forwards_per_token", "wasted_cache_fraction",
    "peak_memory_mib", "rows", "rows_equal_ar", "first_mismatch_row", "first_mismatch_position",
    "first_mismatch_margin", "jsd_target_draft",
]


def write_results(out_dir: str, rows: list[dict], about: dict) -> list[Path]:
    """results.csv, results.json and the plots in out_dir; returns the paths written."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: cell(row[k]) for k in COLUMNS} for row in rows)
    (folder / "results.json").write_text(json.dumps({"about": about, "results": rows}, indent=1) + "\n")
    return [folder / "results.csv", folder / "results.json", *plot(folder, rows)]


def cell(value) -> str:
    """A CSV cell: empty for None, floats to 6 significant digits."""
    return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plots need matplotlib: pip install 'batchspec[report]' (make install has it)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot(folder: Path, rows: list[dict]) -> list[Path]:
    """speedup_vs_gamma.png and alpha_vs_gamma.png (the draft model's cells: each fixed gamma
    and auto, a line per batch size) and throughput_vs_batch.png (a line per method)."""
    plt = pyplot()
    spec = [r for r in rows if r["method"] == "spec"]
    gammas = sorted({r["gamma"] for r in spec}, key=lambda g: (g == "auto", g if g != "auto" else 0))
    paths = []
    for column, label, name in (("speedup_vs_ar", "speed-up over ar", "speedup_vs_gamma.png"),
                                ("alpha", "acceptance alpha", "alpha_vs_gamma.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for size in sorted({r["batch_size"] for r in spec}):
            by_gamma = {r["gamma"]: r[column] for r in spec if r["batch_size"] == size}
            points = [(str(g), by_gamma[g]) for g in gammas if by_gamma.get(g) is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=f"batch {size}")
        if column == "speedup_vs_ar":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set(xlabel="gamma (draft tokens per step)", ylabel=label, title=f"{label} vs gamma")
        ax.legend()
        paths.append(save(fig, folder / name))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(label_of(r) for r in rows):
        points = sorted((r["batch_size"], r["tokens_per_s"]) for r in rows if label_of(r) == method)
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=method)
    sizes = sorted({r["batch_size"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(size) for size in sizes], minor=False)
    ax.minorticks_off()
    ax.set(xlabel="batch size", ylabel="tokens/s", title="throughput vs batch size")
    ax.legend(fontsize="small")
    paths.append(save(fig, folder / "throughput_vs_batch.png"))
    return paths


def label_of(row: dict) -> str:
    return f"{row['method']} gamma={row['gamma']}" if row["gamma"] not in ("", None) else row["method"]


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    return path


def best_configs(path: str, rows: list[dict], settings: dict) -> list[Path]:
    """The fastest batchspec setting of each batch size as a --config TOML, with `settings` (the
    pair, dtype, ...): PATH for one batch size, PATH's stem + "-b<N>" for each of several."""
    sizes = sorted({r["batch_size"] for r in rows})
    written = []
    for size in sizes:
        ours = [r for r in rows if r["batch_size"] == size and r["run_options"] is not None]
        best = max(ours, key=lambda r: r["speedup_vs_ar"])  # side by side with ar, pass by pass (bench.faster)
        stem = Path(path)
        target = stem if len(sizes) == 1 else stem.with_name(f"{stem.stem}-b{size}{stem.suffix}")
        header = f"# batchspec bench: fastest at batch {size}: {label_of(best)}, {best['tokens_per_s']:.1f} tok/s, " \
                 f"{best['speedup_vs_ar']:.2f}x ar\n[run]\n"
        target.write_text(header + as_toml({"batch_size": size, **settings, **best["run_options"]}) + "\n")
        written.append(target)
    return written
