"""PNG plots for `bench policies`: latency and throughput against rate, pool profile, batch size."""
from __future__ import annotations

import os


def plot_policies(results: dict, rates: list[float], bound: float, out_dir: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): skipping the plots")
        return []
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_rate in results.items():
        xs = [float(r) for r in by_rate]
        ax1.plot(xs, [by_rate[r]["normalized_latency_s_per_token"] for r in by_rate], "o-", label=name)
        ax2.plot(xs, [by_rate[r]["output_token_throughput"] for r in by_rate], "o-", label=name)
    ax1.axhline(bound, color="gray", linestyle="--", label="latency bound")
    ax1.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)", yscale="log")
    ax2.set(xlabel="request rate (req/s)", ylabel="output tokens/s")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "throughput_vs_rate.png"))

    top = str(max(rates))
    policies = [p for p in results if p != "transformers"]
    parts = ["token_state", "reserved", "internal_fragmentation", "external_fragmentation", "free"]
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(policies)
    for part in parts:
        vals = [results[p][top]["breakdown"].get(part, 0.0) * 100 for p in policies]
        ax.bar(policies, vals, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="% of KV pool (time-averaged)", title=f"pool profile at {top} req/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "pool_profile.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in policies:
        series = results[p][top]["running_over_time"]
        ax.plot([t for t, _ in series], [n for _, n in series], label=p)
    ax.set(xlabel="time (s)", ylabel="running requests", title=f"batch size at {top} req/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "batch_size_over_time.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
