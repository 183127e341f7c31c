"""The benchmark report: report.md from the JSON that `run_all.py` writes.

    python benchmarks/run_all.py --size=quick     # measures everything, then calls this
    python benchmarks/report.py --out_dir=benchmarks/results   # the report alone, again

Every table names the commit and the kind of machine its figures were measured at (the
stamp each benchmark writes into its JSON, `machine.stamp`), and a table whose figures come
from different commits, or whose timings come from different kinds of machine, is refused:
the refusal stands in its place, naming them. Rate tables compare cells
by their medians, and a difference smaller than the cells' spread (the wider of the two
min-max ranges) is reported as "no difference"; each row's examples per second is also
given as a fraction of the one-process limit measured in the same run.
"""

import json
import os
import statistics
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import capacity  # noqa: E402
from machine import commit_label  # noqa: E402
from machine import kind_text  # noqa: E402
from machine import spread  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    """This script's flags (defined when it runs, not when tests import it)."""
    flags.DEFINE_string("out_dir", os.path.join("benchmarks", "results"),
                        "Where the JSON results are, and where report.md goes.")
    flags.DEFINE_float("bandwidth_gbit", 10.0, "Network bandwidth of the capacity projection.")
    flags.DEFINE_float("latency_us", 50.0, "Network latency of the capacity projection.")


class MixedCommits(ValueError):
    """A table would hold figures measured at different commits."""


def part_commit(result, part):
    """The commit (`commit_label`) that measured `part` of a result file."""
    return result.get("part_commits", {}).get(part) or commit_label(result.get("stamp"))


def measured(result, part=None):
    """`(commit, machine)` that measured `part` of a result file (None: the whole file), a
    table's source: the commit's label and the machine's kind (`kind_text`; None where not
    recorded). A part's machine where the file records it (`machine.record_parts`), else the
    file's last stamp's."""
    machine = (result.get("part_machines", {}).get(part)
               or (result.get("stamp") or {}).get("machine"))
    commit = part_commit(result, part) if part else commit_label(result.get("stamp"))
    return commit, kind_text(machine) if machine else None


def one_commit(sources):
    """The commit every source of a table was measured at.

    Args:
      sources: `{what: commit label}`, e.g. `{"scaling.json": "0123abcd4567"}`, or `{what:
        (commit label, machine kind)}` (`measured`) for figures that depend on the machine.

    Raises:
      MixedCommits: the sources name more than one commit, or more than one kind of machine
        (the message says which is which).
    """
    commits = {what: _commit_of(source) for what, source in sources.items()}
    _one_of(commits, "commits", "in one run (benchmarks/run_all.py)")
    kinds = {what: source[1] for what, source in sources.items()
             if isinstance(source, tuple) and source[1]}
    if kinds:
        _one_of(kinds, "kinds of machine", "on one machine: a ratio compares runs of one "
                "machine")
    return next(iter(commits.values()))


def _commit_of(source):
    return source[0] if isinstance(source, tuple) else source


def _one_of(labels, plural, remedy):
    """Raises MixedCommits unless `labels` (`{what: label}`) hold exactly one label."""
    distinct = sorted(set(labels.values()))
    if len(distinct) != 1:
        by_label = "; ".join(
            f"{label}: {', '.join(sorted(w for w, x in labels.items() if x == label))}"
            for label in distinct)
        raise MixedCommits(f"its figures come from {len(distinct)} {plural} ({by_label}); "
                           f"measure them again {remedy}")


def commit_line(sources):
    """(True, "Measured at commit ... on ...") or (False, "Refused: ...") for a table."""
    try:
        commit = one_commit(sources)
    except MixedCommits as e:
        return False, f"**Table refused**: {e}."
    kinds = {source[1] for source in sources.values() if isinstance(source, tuple)} - {None}
    on = f" on {kinds.pop()}" if kinds else ""
    if commit == "not recorded":
        return True, f"Commit not recorded (results from before the harness stamped them){on}."
    return True, f"Measured at commit `{commit}`{on}."


def compare(cell, reference):
    """A cell against a reference cell, both `{"median", "min", "max"}`.

    Returns:
      None where either has no median (or the reference's is 0), else `{"ratio",
      "difference", "spread", "no_difference"}`: the ratio of the medians, their absolute
      difference, the wider of the two min-max ranges, and whether that spread is at least
      the difference (then the cells do not differ as far as these runs can tell).
    """
    if not cell or not reference or cell.get("median") is None or not reference.get("median"):
        return None
    difference = abs(cell["median"] - reference["median"])
    widest = max(cell["max"] - cell["min"], reference["max"] - reference["min"])
    return {"ratio": cell["median"] / reference["median"], "difference": difference,
            "spread": widest, "no_difference": widest >= difference}


def comparison_text(comparison):
    if comparison is None:
        return ""
    if comparison["no_difference"]:
        return f"no difference ({comparison['ratio']:.2f}x)"
    return f"{comparison['ratio']:.2f}x"


def fraction_of_limit(cell, limits):
    """A cell's median over the best median of the limit cells (None where there is none)."""
    best = max((c["median"] for c in limits if c and c.get("median")), default=None)
    if not best or not cell or cell.get("median") is None:
        return None
    return cell["median"] / best


def model_bytes():
    # The digits MLP of the benchmarks: 64 -> 64 -> 10, float32.
    parameters = 64 * 64 + 64 + 64 * 10 + 10
    return 4 * parameters


def build_capacity(scaling, compression_ratio, bandwidth_gbit=10.0, latency_us=50.0):
    rates = {int(m): r for m, r in scaling["hard sync"].items()}
    compute_s, per_push_s = capacity.fit_local(rates)
    model = capacity.CapacityModel(
        compute_s=compute_s, per_push_s=per_push_s, model_bytes=model_bytes(),
        bandwidth_bytes_s=bandwidth_gbit * 1e9 / 8, latency_s=latency_us * 1e-6,
        compression_ratio=compression_ratio)
    workers = [8, 16, 32, 64, 128, 256, 512, 1024]
    return {"fit": {"compute_s": compute_s, "per_push_s": per_push_s,
                    "model_bytes": model.model_bytes, "bandwidth_gbit": bandwidth_gbit,
                    "latency_us": latency_us, "jitter": model.jitter,
                    "compression_ratio": model.compression_ratio},
            "local_check": capacity.check_local(rates, compute_s, per_push_s),
            "projection": model.projections(workers)}


def plot_capacity(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["projection"]
    workers = [r["workers"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in rows[0]:
        if key != "workers":
            ax.plot(workers, [1000 * r[key] for r in rows], marker="o",
                    label=key[:-2].replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("projected step time (ms)")
    ax.set_title(f"Capacity model, {result['fit']['bandwidth_gbit']:g} Gbit/s, digits MLP")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _static_batch_note(exchange):
    """The baseline with every batch's size known when traced (results from before it was
    measured have none)."""
    static = exchange.get("static_batch")
    if not static:
        return ""
    return (f", with batches whose size is not known when the step is traced (tfdist then "
            f"weighs each replica's gradient by its examples, which makes a batch that the "
            f"replicas do not divide exact; TF's strategy does not); **"
            f"{static['step_time_ratio']:.3f}**{_ratio_spread_text(static)} with "
            f"`drop_remainder=True` (every size known, nothing weighted; {static['repeats']} "
            f"repeats)")


def _ratio_spread_text(figures):
    """" (quartiles a–b, min–max c–d, of n pairs)" of a step-time ratio, where the run kept
    its spread (results from before it did have the median only)."""
    ratio = figures.get("step_time_ratio_spread")
    if not ratio:
        return ""
    return (f" (quartiles {ratio['q1']:.3f}–{ratio['q3']:.3f}, min–max {ratio['min']:.3f}–"
            f"{ratio['max']:.3f} of {ratio['pairs']} neighbouring pairs)")


def compression_section(result):
    exchange, accuracy = result["exchange"], result["accuracy"]
    parts = ["## Compressed gradient exchange", "",
             "`benchmarks/compression.py`: one process, 2 replicas on 2 logical CPU devices. "
             f"Step time of `CompressedMirroredStrategy(compression=None)` over TF's "
             f"`MirroredStrategy` on the same job (MLP, {exchange['model_parameters']:,} "
             f"parameters, interleaved runs, median): **{exchange['step_time_ratio']:.3f}**"
             f"{_ratio_spread_text(exchange)} (target ≤ 1.03)" + _static_batch_note(exchange)
             + "." + _load_text(result) + _part_loads_text(result), "",
             "Bytes one replica sends per step (from the Keras logs of training) against dense "
             "float32, the step time with the compressor against the same exchange with "
             "`none`, and one replica's encode + decode time (its payload in, every payload "
             "out, on the model's real gradients) as a share of the step. The 2 replicas share "
             "2 cores, so a step also pays for the other replica's codec.", ""]
    cnn = exchange.get("cnn")
    if cnn:
        per_parameter = ""
        if "none" in cnn["compressors"] and "none" in exchange["compressors"]:
            ratio = ((cnn["compressors"]["none"]["step_seconds"] / cnn["model_parameters"])
                     / (exchange["compressors"]["none"]["step_seconds"]
                        / exchange["model_parameters"]))
            per_parameter = f", whose step takes {ratio:.1f}x the MLP's time per parameter"
        parts += [f"The last columns: the same on a small CIFAR-size CNN "
                  f"({cnn['model_parameters']:,} parameters){per_parameter}. A codec's cost "
                  "grows with the parameters, a step's with the samples and their compute: "
                  "the MLP is the hard case.", ""]
    rows = []
    for name, r in exchange["compressors"].items():
        row = [name, f"{int(r['bytes_sent']):,}", f"{r['bytes_ratio']:.1f}x",
               f"{1000 * r['step_seconds']:.2f}", f"{1000 * r['step_seconds_uncompressed']:.2f}",
               f"{100 * r['codec_share']:.1f} %"]
        if cnn:
            c = cnn["compressors"][name]
            row += [f"{1000 * c['step_seconds']:.2f}", f"{100 * c['codec_share']:.1f} %"]
        rows.append(row)
    header = ["compressor", "bytes sent", "vs dense fp32", "step ms", "step ms (none)",
              "codec share"]
    parts += [_table(header + (["CNN step ms", "CNN codec share"] if cnn else []), rows), ""]
    base = accuracy["uncompressed"]
    parts += [f"Digits test accuracy, {accuracy['epochs']} epochs, seeds {accuracy['seeds']} "
              f"(uncompressed: {base['mean']:.4f} ± {base['std']:.4f}); points against "
              "uncompressed:", ""]
    rows = []
    for name, entry in accuracy["compressors"].items():
        cells = [name]
        for key in ("error_feedback", "no_error_feedback"):
            r = entry.get(key)
            cells.append("" if r is None else
                         f"{r['mean']:.4f} ± {r['std']:.4f} ({r['vs_uncompressed_points']:+.2f})")
        rows.append(cells)
    parts += [_table(["compressor", "with error feedback", "without"], rows), "",
              "![compression](compression.png)", ""]
    return parts


def _timing_steps(result):
    """"20", or "20 (8 at 1gbit, N=8)" where settings were timed over other step counts."""
    by_setting = result.get("timing_steps_by_setting", {})
    steps = {s: by_setting.get(s, result.get("timing_steps", "?")) for s in result["timing"]}
    counts = list(steps.values())
    common = max(counts, key=counts.count) if counts else "?"
    others = [f"{n} at {s}" for s, n in sorted(steps.items()) if n != common]
    return f"{common} ({'; '.join(others)})" if others else f"{common}"


def network_section(result):
    """Step time and accuracy of every compressor on a rate-limited network
    (`benchmarks/network.py`), with the wire bytes at each measured N."""
    parts = ["## Compression on a slow network", "",
             f"`benchmarks/network.py`: {result['job']}; {result['network']}; "
             f"{result['machine']}. Timing: median seconds per step of the chief over "
             f"{_timing_steps(result)} steps; speed-up = uncompressed step time over "
             "the codec's at the same bandwidth and N, in the same run (DGC timed without its "
             "warm-up; codecs left out of a setting are blank). `bytes_on_wire` is what one "
             "worker sends and receives per step at that N (Keras logs); the ratio is the dense "
             "ring all-reduce's over it." + _load_text(result) + _part_loads_text(result), ""]
    timing = result.get("timing", {})
    settings = sorted(timing)
    ok, line = commit_line({f"timing/{s}": measured(result, f"timing/{s}")
                            for s in settings})
    if settings:
        parts += [f"Step times. {line} \"of the limit\": the step time of one process (plain "
                  "Keras `fit`, no strategy, no network) on the same global batch over the "
                  "row's.", ""]
    if settings and ok:
        names = list(dict.fromkeys(name for s in settings for name in timing[s]))
        header = ["compressor"] + [f"{s}: s/step (min–max; speed-up; of the limit)"
                                   for s in settings]
        by_n = {}
        for setting in settings:
            by_n.setdefault(setting.split("N=")[1], setting)
        header += [f"wire bytes, ratio (N={n})" for n in by_n]
        rows = []
        for name in names:
            row = [name]
            for setting in settings:
                r = timing[setting].get(name, {})
                row.append(step_cell(r, timing[setting].get("none", {})))
            for setting in by_n.values():
                r = timing[setting].get(name, {})
                row.append(f"{int(r['bytes_on_wire']):,}, {r['compression_ratio']:.1f}x"
                           if "bytes_on_wire" in r else "")
            rows.append(row)
        parts += [_table(header, rows), ""] + _links_text(result)
    accuracy = result.get("accuracy", {})
    ok, line = commit_line({"accuracy": measured(result, "accuracy")})
    if accuracy and not ok:
        parts += [line, ""]
    elif accuracy:
        setting = result["accuracy_setting"]
        parts += [f"{line} Digits test accuracy after {setting['epochs']} epochs, N = "
                  f"{setting['workers']} (network: {setting['bandwidth'] or 'no limit'}; one "
                  "seed), and points against uncompressed:", ""]
        rows = [[name, f"{r['test_accuracy']:.4f}" if "test_accuracy" in r else "error",
                 f"{100 * r['accuracy_difference']:+.1f}" if "accuracy_difference" in r else "",
                 f"{r['loss'][-1]:.3f}" if r.get("loss") else ""]
                for name, r in accuracy.items()]
        parts += [_table(["compressor", "test accuracy", "points", "final loss"], rows), ""]
    parts += ["![network](network.png)", ""]
    return parts


def _links_text(result):
    """The links measured before each setting's timing (`tfdist.launch.links`): the rate
    each pair of workers got with every pair sending at once, against the set rate."""
    measured = result.get("links", {})
    if not measured:
        return []
    lines = []
    for setting, r in sorted(measured.items()):
        if "error" in r:
            lines.append(f"{setting}: not measured ({r['error'][:100]})")
            continue
        got = [p / r["set_rate"] for p in r["pairs"]] if r.get("set_rate") else []
        held = f" ({min(got):.0%}–{max(got):.0%} of the set rate)" if got else ""
        lines.append(f"{setting}: {len(r['pairs'])} pair(s) on the {r.get('topology')} "
                     f"network, {min(r['pairs']) / 1e6:,.0f}–{max(r['pairs']) / 1e6:,.0f} "
                     f"Mbit/s a pair{held}, {r['aggregate'] / 1e6:,.0f} Mbit/s together")
    return ["Links, measured before each setting's timing (every pair of its workers sending "
            "at once, plain TCP, `tfdist.launch.links`): " + "; ".join(lines) + ".", ""]


def step_cell(cell, uncompressed):
    """"s/step (min–max; speed-up; fraction of the limit)" of a timing cell, the speed-up
    against uncompressed's cell "no difference (...)" where their spreads cover it."""
    if "seconds_per_step" not in cell:
        return "error" if cell else ""
    steps = cell.get("seconds_per_step_spread")
    text = f"{cell['seconds_per_step']:.3f}"
    notes = [f"{steps['min']:.3f}–{steps['max']:.3f}"] if steps else []
    if "speedup" in cell and cell is not uncompressed:
        speedup = f"{cell['speedup']:.1f}x"
        comparison = compare(steps, uncompressed.get("seconds_per_step_spread"))
        notes.append(f"no difference ({speedup})" if comparison and
                     comparison["no_difference"] else speedup)
    if "fraction_of_limit" in cell:
        notes.append(f"{cell['fraction_of_limit']:.2f}")
    return f"{text} ({'; '.join(notes)})" if notes else text


def sgp_network_section(result):
    """Stochastic Gradient Push against uncompressed all-reduce on a rate-limited network
    (`benchmarks/network.py --sgp`, its own run)."""
    parts = ["## Stochastic Gradient Push on a slow network", "",
             f"`benchmarks/network.py --sgp --compressors=none`: {result['job']}; "
             f"{result['network']}; {result['machine']}. Median seconds per step of the chief "
             f"over {_timing_steps(result)} steps, both rows in the same run; "
             "speed-up = all-reduce's step time over SGP's. Wire bytes: what one worker sends "
             "and receives per step (SGP: its one message out, one in; all-reduce: the dense "
             "ring's 2 x 2 (N - 1) / N x 4 bytes per parameter, computed); ratio: the dense ring "
             "all-reduce's over it." + _load_text(result), ""]
    rows = []
    for setting, row in sorted(result.get("timing", {}).items()):
        for name, label in (("none", "all-reduce (MultiWorkerMirrored), uncompressed"),
                            ("sgp", "SGP (exponential graph, 1 peer, overlap)")):
            r = dict(row.get(name, {}))
            if name == "none" and "parameters" in r:  # (no Keras log of it uncompressed)
                n = r["workers"]
                r.update(bytes_on_wire=2 * 2 * (n - 1) / n * 4 * r["parameters"],
                         compression_ratio=1.0)
            # (all-reduce is the reference: its row gets no speed-up over itself)
            rows.append([setting, label,
                         step_cell(r, r if name == "none" else row.get("none", {}))
                         if "seconds_per_step" in r else (r.get("error", "")[:80] or ""),
                         f"{int(r['bytes_on_wire']):,} ({r['compression_ratio']:.2f}x)"
                         if "bytes_on_wire" in r else ""])
    return parts + [_table(["network, N", "strategy", "s/step (min–max; speed-up; of the limit)",
                            "wire bytes/step"], rows), ""]


def _range(cell, digits=1):
    if not cell or cell.get("median") is None:
        return "error"
    return (f"{cell['median']:,.{digits}f} ({cell['min']:,.{digits}f}–"
            f"{cell['max']:,.{digits}f})")


def _loads(runs):
    """"low–high" of the 1-minute load averages before and after a cell's runs."""
    values = [run[key][0] for run in runs for key in ("load_before", "load_after")
              if run.get(key)]
    return f"{min(values):g}–{max(values):g}" if values else ""


PEER_OF = {"async, 1 ps": "", "async, 1 ps, steps_per_execution 10": ", steps_per_execution 10"}


def rates_section(rates):
    parts = ["## Update rates, every strategy on one job", ""]
    if not isinstance(next(iter(rates["rows"].values()))["updates_per_second"], dict):
        return parts + ["This rates.json predates the harness (no repeats' spread, no commit, "
                        "unequal work under MultiWorkerMirrored): measure it again with "
                        "`benchmarks/run_all.py`.", ""]
    ok, line = commit_line({"rates.json": measured(rates)})
    parts += [line + " " + (
        f"{rates['num_workers']} workers, {rates['job']}, {rates['network']}. Equal work: "
        f"every worker computes {rates['rows_per_worker_step']} rows a step in every row "
        "(MultiWorkerMirrored's global batch is that times the workers); \"rows/update\" is "
        "what one update averages. Global updates per second on the chief and the rows per "
        f"second that went into updates, over {rates['window_seconds']:g} s windows: median "
        f"(min–max) of {rates['repeats']} interleaved runs. \"of the limit\": examples per "
        "second over the faster of the one-process rows (plain Keras `fit`, no strategy, "
        "the same cores, the global batch of a synchronous update). Comparisons are ratios "
        "of medians, \"no difference\" where the spread of either cell is as wide as the "
        "difference; async rows also against tf_keras `fit` under TF's "
        "ParameterServerStrategy (its async training) at the same steps_per_execution. Load: "
        "the 1-minute load average before and after the row's runs." + _load_text(rates)), ""]
    if not ok:
        return parts
    rows_data = rates["rows"]
    reference = rows_data.get(rates["reference"], {})
    limits = [rows_data[name]["examples_per_second"] for name in rates.get("limit", [])
              if name in rows_data]
    table = []
    for name, row in rows_data.items():
        fraction = fraction_of_limit(row["examples_per_second"], limits)
        peer_name = ("tf_keras ParameterServerStrategy, 1 ps" + PEER_OF[name]
                     if name in PEER_OF else None)
        peer = rows_data.get(peer_name, {}).get("examples_per_second")
        table.append([
            name, f"{row['rows_per_update']:g}" if row.get("rows_per_update") else "",
            _range(row["updates_per_second"]), _range(row["examples_per_second"], 0),
            "" if fraction is None else f"{fraction:.2f}",
            "" if name == rates["reference"] else comparison_text(
                compare(row["updates_per_second"], reference.get("updates_per_second"))),
            "" if name == rates["reference"] else comparison_text(
                compare(row["examples_per_second"], reference.get("examples_per_second"))),
            comparison_text(compare(row["examples_per_second"], peer)),
            _loads(row.get("runs", []))])
    parts += [_table(["mode", "rows/update", "updates/s (min–max)", "examples/s (min–max)",
                      "of the limit", "updates vs all-reduce", "examples vs all-reduce",
                      "vs tf_keras PSS", "load"], table), ""]
    held = ", ".join(f"{k}: {' / '.join(str(b) for b in v)} bytes"
                     for k, v in rates["bytes_per_ps_task"].items())
    if held:
        parts += [f"Bytes one push of a worker carries to each ps task (its reply carries as "
                  f"much back), as the runs placed the model: {held}.", ""]
    sent = {name: row["bytes_sent_per_worker_step"] for name, row in rows_data.items()
            if "bytes_sent_per_worker_step" in row}
    if sent:
        parts += ["Bytes an SGP worker sends per step (its messages, one per out-peer): "
                  + ", ".join(f"{name}: {b:,.0f}" for name, b in sent.items()) + ".", ""]
    errors = [f"{name}: {run['error'][:200]}" for name, row in rows_data.items()
              for run in row.get("runs", []) if "error" in run]
    if errors:
        parts += ["Runs that failed (left out of their cells): " + "; ".join(errors), ""]
    return parts


def _spread(figure, scale=1.0, digits=1):
    """"median (min-max)" of a summarized figure, or "" when no run gave it."""
    if not figure:
        return ""
    median, low, high = (scale * figure[k] for k in ("median", "min", "max"))
    if low == high:
        return f"{median:,.{digits}f}"
    return f"{median:,.{digits}f} ({low:,.{digits}f}-{high:,.{digits}f})"


def _embedding_series(result):
    """`{(label, workers, ps): [cells by V]}` of `embedding.json`."""
    series = {}
    for cell in result["cells"]:
        series.setdefault((cell["label"], cell["workers"], cell["ps"]), []).append(cell)
    return {key: sorted(cells, key=lambda c: c["rows"]) for key, cells in series.items()}


def embedding_title(result):
    """The heading of an embedding result's section: the matrix, or the one cluster shape a
    run of repeats measured."""
    settings = result["settings"]
    shape = ""
    if len(settings.get("workers", ())) == 1 and len(settings.get("ps", ())) == 1:
        shape = (f", {_repeats_made(result)} repeats at {settings['workers'][0]} workers, "
                 f"{settings['ps'][0]} ps")
    return f"## Embedding tables: a recommendation job against V{shape}"


def _repeats_made(result):
    """How many interleaved runs the cells have (a run stopped early made fewer than its
    `repeats`)."""
    return max((len(cell["runs"]) for cell in result["cells"]), default=0)


def _nearest(result):
    """Which estimate ("rows_only" or "every_id") tfdist's measured bytes per worker step are
    nearest to, for results that do not say what its step moves (those from before lookups
    moved each distinct id once, and the first runs after)."""
    votes = []
    for cell in result.get("cells", []):
        measured = (cell.get("bytes_per_worker_step") or {}).get("median")
        e = result["estimates"].get(str(cell.get("rows")), {})
        if cell.get("system") in ("async", "hard_sync") and measured and e.get(
                "every_id_bytes_per_worker_step"):
            votes.append(min(("rows_only", "every_id"), key=lambda k: abs(
                measured - e[f"{k}_bytes_per_worker_step"])))
    return max(set(votes), key=votes.count) if votes else None


def embedding_section(result, plot="embedding.png"):
    """Tables on the ps (`benchmarks/embedding.py`): rate, bytes, memory and accuracy of
    every system against V."""
    settings = result["settings"]
    mib = 1 / 2**20
    parts = [embedding_title(result), "",
             f"`benchmarks/embedding.py`: {settings['job']} Batch {settings['batch_size']} per "
             f"worker step, steps_per_execution {settings['steps_per_execution']} for every "
             f"system; tfdist `embedding_tables={settings['embedding_tables']}` where the "
             "strategy takes it (else every worker mirrors every table). Median (min-max) of "
             f"{_repeats_made(result)} interleaved runs"
             + (f" ({settings['repeats']} planned)" if _repeats_made(result)
                != settings["repeats"] else "")
             + f", {settings['window']:g} s windows after "
             f"{settings['warmup']:g} s; an update is one change of the ps variables (hard sync:"
             " one per `workers` pushes); examples/s = pushes x batch; vs peer and vs "
             "smallest V are ratios of examples/s medians, \"no difference\" where either "
             "cell's min-max range is as wide as the difference. Bytes: the cluster's "
             "private loopback over the window per worker step, both ways, headers included. "
             "Memory: the largest peak resident set (VmHWM) of a worker, of a ps task. Accuracy"
             f" and loss: on 20,000 held-out examples after {settings['quality_examples']:,} "
             "training examples, points against one process at the same V; hard sync's "
             "against one process at its global batch (`workers` x batch: hard sync takes one "
             "update per `workers` batches, so after the same examples that many times fewer "
             "updates), where that was measured (accuracy only, one seeded run)."
             + ("" if settings.get("complete", True) else
                " **An incomplete run** (stopped before every run was made): only the cells "
                "measured are shown.") + _merged_text(result) + _sittings_text(result)
             + _load_text(result), ""]
    # (Results from before the every-id estimate have no such column.)
    every_id = all("every_id_bytes_per_worker_step" in e for e in result["estimates"].values())
    rows = [[f"{int(v):,}", f"{e['parameters']:,}",
             f"{sum(e['unique_rows_per_batch'].values()):,.0f}",
             f"{e['rows_only_bytes_per_worker_step']:,.0f}",
             *([f"{e['every_id_bytes_per_worker_step']:,.0f}"] if every_id else []),
             f"{e['whole_model_bytes_per_worker_step']:,.0f}"]
            for v, e in result["estimates"].items()]
    moves = next(iter(result["estimates"].values()), {}).get("tfdist_moves") or _nearest(result)
    rows_note = (": what tfdist's step moves, besides the distinct ids it looks up"
                 if moves == "rows_only" else "")
    every_note = ("what tfdist's step moves: " if moves == "every_id" else "")
    parts += ["Estimates (payload only) of one worker step's bytes: rows only (each distinct row "
              f"a batch touches read once, its gradient and id pushed once, the dense part both "
              f"ways{rows_note})"
              + (f", every id ({every_note}each id looked up, repeated ones "
                 "included, sent and its row back, its gradient row and id pushed, the dense "
                 "part both ways)" if every_id else "")
              + " and the whole model both ways:", "",
              _table(["V", "parameters", "distinct rows / batch", "rows only (bytes)",
                      *(["every id (bytes)"] if every_id else []),
                      "whole model (bytes)"], rows), ""]
    series = _embedding_series(result)
    one = {c["rows"]: c for c in result["cells"] if c["system"] == "one_process"}
    one_global = {(c["workers"], c["rows"]): c for c in result["cells"]
                  if c["system"] == "one_process_global"}
    peers = {(c["workers"], c["ps"], c["rows"]): c for c in result["cells"]
             if c["system"] == "peer"}
    rows = []
    for (label, workers, num_ps), cells in series.items():
        first = cells[0].get("examples_per_second")
        for cell in cells:
            rate = cell.get("examples_per_second")
            peer = peers.get((workers, num_ps, cell["rows"]), {}).get("examples_per_second")
            errors = sum(1 for run in cell["runs"] if run.get("error"))
            accuracy = cell.get("accuracy")
            reference = one.get(cell["rows"], {})
            if cell["system"] == "hard_sync":
                reference = one_global.get((workers, cell["rows"]), reference)
            base = reference.get("accuracy")
            points = (f" ({100 * (accuracy['median'] - base['median']):+.1f})"
                      if accuracy and base and not cell["system"].startswith("one_process")
                      else "")
            rows.append([label, workers, num_ps or "", f"{cell['rows']:,}",
                         _spread(cell.get("updates_per_second")), _spread(rate, digits=0),
                         comparison_text(compare(rate, peer))
                         if cell["system"] != "peer" else "",
                         "1.00x" if cell is cells[0] and rate
                         else comparison_text(compare(rate, first)),
                         _spread(cell.get("bytes_per_worker_step"), digits=0),
                         _spread(cell.get("worker_peak_bytes"), mib, 0),
                         _spread(cell.get("ps_peak_bytes"), mib, 0),
                         _spread(accuracy, digits=3) + points, _spread(cell.get("loss"),
                                                                      digits=3),
                         f"{errors} of {len(cell['runs'])}" if errors else ""])
    parts += [_table(["system", "workers", "ps", "V", "updates/s", "examples/s", "vs peer",
                      "vs smallest V", "bytes / worker step", "worker peak MiB", "ps peak MiB",
                      "accuracy (points vs one process; hard sync: at its global batch)",
                      "loss", "failed runs"], rows), "",
              f"![embedding]({plot})", ""]
    return parts


def _sittings_text(result):
    """Where a run was carried on (`--resume`) over several sittings: how many, and the load
    at the start of each."""
    sittings = result.get("stamp", {}).get("sittings") or []
    if len(sittings) < 2:
        return ""
    loads = "; ".join(" / ".join(str(x) for x in s["load_before"]) for s in sittings
                      if s.get("load_before"))
    return (f" Measured in {len(sittings)} sittings of the same commit (`--resume`: each "
            f"carried on in the same interleaved order where the last stopped; the load at "
            f"the start of each: {loads}).")


def run_text(out_dir, present):
    """The header's account of the run that wrote `out_dir` (`run_all.json`): its commit,
    size and sittings, what finished, what failed or was stopped, and every result file that
    is not of this run (another run's, one run by hand, or one that cannot be read)."""
    if "run_all.json" not in present:
        return []
    with open(os.path.join(out_dir, "run_all.json")) as f:
        run = json.load(f)
    benchmarks = run.get("benchmarks", {})
    finished = [name for name, entry in benchmarks.items() if entry.get("finished")]
    failed = [name for name, entry in benchmarks.items() if entry.get("failed")]
    stopped = [name for name, entry in benchmarks.items()
               if not entry.get("finished") and not entry.get("failed")]
    sittings = run.get("sittings", [])
    count = f"{len(sittings)} sitting{'s' * (len(sittings) != 1)}"
    if sittings:
        count += (f" (the first started {sittings[0]['started']}, the last "
                  f"{sittings[-1]['started']})" if len(sittings) > 1
                  else f" (started {sittings[0]['started']})")
    hosts = {json.dumps(s.get("machine"), sort_keys=True) for s in sittings if s.get("machine")}
    kinds = {kind_text(s["machine"]) for s in sittings if s.get("machine")}
    if len(kinds) > 1:
        on = {}
        for name, entry in benchmarks.items():
            on.setdefault(kind_text(entry.get("machine") or run.get("machine")), []).append(name)
        count += (f" on {len(kinds)} kinds of machine, each benchmark on one ("
                  + "; ".join(f"{', '.join(names)}: {kind}" for kind, names in on.items())
                  + "; `run_all.json` records each sitting's)")
    elif len(hosts) > 1:
        count += (f" on {len(hosts)} machines of one kind ({kind_text(run.get('machine'))}; "
                  f"`run_all.json` records each sitting's)")
    again = [f"{name} ({entry['begun_again']})" for name, entry in benchmarks.items()
             if entry.get("begun_again")]
    text = (f"This run: `run_all.py --size={run.get('size')}`"
            f"{' with the tf_keras peer' if run.get('peer') else ' (no peer rows)'} at commit "
            f"`{commit_label(run)}`, in {count}. Finished: {', '.join(finished) or 'none'}."
            + (f" Failed: {', '.join(failed)}." if failed else "")
            + (f" Not finished (stopped): {', '.join(stopped)}." if stopped else "")
            + (f" Begun again on another kind of machine: {'; '.join(again)}." if again
               else ""))
    others = []
    for name in sorted(present - {"run_all.json", "capacity.json"}):
        try:
            with open(os.path.join(out_dir, name)) as f:
                result_stamp = json.load(f).get("stamp") or {}
        except (OSError, ValueError) as e:
            others.append(f"{name} (cannot be read: {e})")
            continue
        if result_stamp.get("run") != run.get("run"):
            others.append(f"{name} ({commit_label(result_stamp)}"
                          f"{', by hand' if not result_stamp.get('run') else ', another run'})")
    if others:
        text += (" **Results not of this run in this directory** (their tables name their "
                 "commits): " + ", ".join(others) + ".")
    return [text, ""]


def _merged_text(result):
    """Where an `embedding.json` joins the cells of several runs: each run's commit, V and
    systems, as `merged_from` records them."""
    merged = result.get("merged_from")
    if not merged:
        return ""
    runs = "; ".join(f"`{str(m['commit'])[:12]}`: V {', '.join(f'{int(v):,}' for v in m['rows'])}"
                     f" ({', '.join(m['systems'])}, {m['cells']} cells)" for m in merged)
    return f" The cells come from {len(merged)} runs of the same tfdist code: {runs}."


def plot_embedding(result, path):
    """Examples per second and a worker's peak memory against V (log x), one line per
    system, workers and ps; bars from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, memory_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    # A line style per system, a colour per cluster shape (workers, ps).
    styles = {"async": "-", "hard_sync": "--", "peer": ":", "one_process": "-."}
    shapes = sorted({(c["workers"], c["ps"]) for c in result["cells"]})
    for (label, workers, num_ps), cells in _embedding_series(result).items():
        system = cells[0]["system"]
        if system not in styles:
            continue  # accuracy only
        name = label if label.startswith("one process") else f"{label}, {workers} w, {num_ps} ps"
        look = {"linestyle": styles[system],
                "color": "black" if system == "one_process"
                else f"C{shapes.index((workers, num_ps))}"}
        for ax, key, scale in ((rate_ax, "examples_per_second", 1.0),
                               (memory_ax, "worker_peak_bytes", 1 / 2**20)):
            points = [(c["rows"], c[key]) for c in cells if c.get(key)]
            if not points:
                continue
            x = [v for v, _ in points]
            y = [scale * f["median"] for _, f in points]
            error = [[scale * (f["median"] - f["min"]) for _, f in points],
                     [scale * (f["max"] - f["median"]) for _, f in points]]
            ax.errorbar(x, y, yerr=error, marker="o", capsize=3, label=name, **look)
    for ax, ylabel in ((rate_ax, "examples / s (all workers)"),
                       (memory_ax, "peak resident memory of a worker (MiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("V (rows of the large table)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    rate_ax.set_yscale("log")
    memory_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("Embedding tables: rate and worker memory against V")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _load_text(results):
    """The load average a benchmark recorded, for its section's header."""
    run_stamp = results.get("stamp")
    if run_stamp and run_stamp.get("load_before"):
        before, after = run_stamp["load_before"], run_stamp.get("load_after", [])
        machine = run_stamp.get("machine", {})
        return (f" Load average (1 / 5 / 15 min) {' / '.join(f'{x:g}' for x in before)} at "
                f"the start, {' / '.join(f'{x:g}' for x in after)} at the end; machine: "
                f"{machine.get('cpus')} cores ({machine.get('cpu_model')}), "
                f"{machine.get('memory_gib')} GiB.")
    if "load_before" not in results:
        return ""
    before, after = (results[k]["load_average_1_5_15"] for k in ("load_before", "load_after"))
    return (f" Load average (1 / 5 / 15 min) {' / '.join(f'{x:g}' for x in before)} at the "
            f"start, {' / '.join(f'{x:g}' for x in after)} at the end, on "
            f"{results['load_before']['cpus']} cores shared with other jobs.")


def _part_loads_text(result):
    """Each part's load average where the parts of a result file were measured in different
    sittings (their loads differ): the file's one stamp has only the last sitting's."""
    loads = result.get("part_loads", {})
    if len({json.dumps(load, sort_keys=True) for load in loads.values()}) < 2:
        return ""

    def _load(values):
        return " / ".join(f"{x:g}" for x in values) if values else "?"

    return (" Load average (1 / 5 / 15 min) at the start and end of each part's sitting: "
            + "; ".join(f"{part}: {_load(load.get('load_before'))} to "
                        f"{_load(load.get('load_after'))}"
                        for part, load in sorted(loads.items())) + ".")


def _rows_per_update(cell):
    """The rows an update of a straggler cell averages (from its runs where the cell does not
    say: results from before it did)."""
    rows = cell["baseline"].get("rows_per_update")
    if rows is None:
        found = [r["baseline"]["rows_per_update"] for r in cell.get("repeats", [])
                 if "rows_per_update" in r.get("baseline", {})]
        rows = statistics.median(found) if found else None
    return "" if rows is None else f"{rows:g}"


def straggler_section(straggler):
    every = straggler.get("stall_every")
    scenarios = straggler.get("scenarios", ["persistent"])
    parts = ["## Update rate with stragglers", ""]
    if "stamp" not in straggler:
        return parts + ["This straggler.json predates the harness (one run per cell, no "
                        "commit, unequal work under MultiWorkerMirrored): measure it again "
                        "with `benchmarks/run_all.py`.", ""]
    parts += [f"1 ps + {straggler['num_workers']} workers (all-reduce, SGP: no ps), "
              f"{straggler['job']}, {straggler['network']}. Rate = chief's global steps per "
              f"second over {straggler['window_seconds']:g} s; ratio = rate with the "
              "straggler / rate without, in the same repeat; median (min–max) of "
              f"{straggler['repeats']} interleaved repeats, \"no difference\" where the "
              "rates with and without overlap by the report's rule. \"of the limit\": "
              "examples per second without straggler over one process's (plain Keras `fit`, "
              "no strategy, the global batch of a synchronous update). Persistent: the last "
              f"worker {straggler['slowdown']:g}x slower at every step."
              + (f" Transient: the last worker stalls for {straggler['stall_steps']:g} of its "
                 f"step times once every {every} steps. Rotating: every worker stalls so, in "
                 "turn. \"paid\": the ratio if everyone paid every stall in full, K t / (K t "
                 "+ n d) (t: the chief's step time without straggler, n stalls of d seconds "
                 "per K steps), what a barrier (hard sync, all-reduce) pays; for soft sync and "
                 "async, whose t is not a worker's step, only a scale. On shared cores a "
                 "stalled worker also frees a core for the others: ratios above 1 are that "
                 "and noise." if len(scenarios) > 1 else "")
              + _load_text(straggler), ""]
    header = ["mode", "rows/update", "no straggler (updates/s)", "examples/s", "of the limit"]
    for scenario in scenarios:
        header += [f"{scenario} (updates/s)", "ratio"]
        if scenario != "persistent":
            header.append("paid")
    limit = straggler.get("limit", {}).get("examples_per_second")
    rows = []
    for name, r in straggler["modes"].items():
        if "baseline" not in r:
            rows.append([name, "does not run: " + r.get("error", "")[:120]]
                        + [""] * (len(header) - 2))
            continue
        fraction = fraction_of_limit(r["baseline"].get("examples_per_second"), [limit])
        row = [name, _rows_per_update(r), _range(r["baseline"]["updates_per_second"]),
               (_range(r["baseline"]["examples_per_second"], 0)
                if "examples_per_second" in r["baseline"] else ""),
               "" if fraction is None else f"{fraction:.2f}"]
        for scenario in scenarios:
            done = r.get(scenario, {})
            if "rate_ratio" in done:
                comparison = compare(done["updates_per_second"],
                                     r["baseline"]["updates_per_second"])
                ratio = _range(done["rate_ratio"], 2)
                row += [_range(done["updates_per_second"]),
                        f"no difference ({ratio})" if comparison["no_difference"] else ratio]
            else:
                row += ["error", done.get("error", "")[:60]]
            if scenario != "persistent":
                row.append(f"{done['ratio_if_paid']:.2f}" if "ratio_if_paid" in done else "")
        rows.append(row)
    return parts + [_table(header, rows), "", "![straggler](straggler.png)", ""]


def _fault_outcome(run):
    """"finished", "failed: <task> exit <code>: <its error>", or "did not end: <tasks> still
    running"."""
    if run.get("error"):
        return "not run: " + run["error"][:100]
    if not run["ended"]:
        return f"did not end: {', '.join(run['still_running'])} still running"
    faulted = set(run.get("stopped_for_good", ())) | set(run.get("killed", ()))
    failed = [(task, code) for task, code in sorted(run["exit_codes"].items())
              if code not in (0, None) and task not in faulted]
    if not failed:
        return "finished"
    task, code = failed[0]
    error = (run.get("errors") or {}).get(task)
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return (f"failed: {task} exit {code}{more}" + (f": {error[:120]}" if error else "")
            ).replace("|", "/")


def _fault_updates(run):
    """The update count's verdict and its figures."""
    verdict = run.get("updates", "")
    if "pushes_applied" in run:
        return (f"{verdict}: {run['pushes_sent']:,} sent, {run['pushes_applied']:,} applied + "
                f"{run['pushes_dropped']:,} dropped")
    if "messages_sent" in run:
        mass = run.get("final_weight_sum")
        return (f"{verdict}: {run['messages_sent']:,} messages sent, {run['messages_taken']:,}"
                f" taken; mass {'?' if mass is None else f'{mass:.4f}'}")
    return verdict


def faults_section(result):
    """Faults on a running job (`benchmarks/faults.py`): did it end, how long after the
    fault, at what accuracy against the fault-free run, was an update lost or applied
    twice."""
    settings = result["settings"]
    parts = ["## Faults on a running job", ""]
    if settings.get("quick"):
        parts += ["**Quick size** (`--quick`: a few scenarios, short epochs, tasks forked from "
                  "a preloaded server): a check of the harness; its figures are not for "
                  "quoting.", ""]
    parts += [f"`benchmarks/faults.py`: {settings['num_workers']} workers, {result['job']}; "
              f"soft sync and async with 1 ps and `stall_timeout={settings['stall_timeout']:g}`"
              ", SGP with its defaults and no ps. The fault hits the chief (worker 0) or the "
              f"last worker once it has trained {settings['fault_epoch']} of its "
              f"{settings['epochs']} epochs: kill = SIGKILL; restart = SIGKILL, then the task "
              f"started again {settings['restart_delay']:g} s later with the same TF_CONFIG "
              f"(its `BackupAndRestore` resumes it); pause = SIGSTOP, SIGCONT "
              f"{settings['pause']:g} s later; hang = SIGSTOP for good. Ended: every worker "
              "not stopped for good exited, within "
              f"{settings['end_timeout']:g} s plus the fault-free run's time after the fault "
              "(seconds after the fault; the whole job's in brackets). Accuracy: held-out, of "
              "the chief's model after `join()` (or the first surviving worker's), points "
              "against the fault-free run's. Updates: the steps the workers completed (each "
              "pushes once; summed over the processes, killed ones included) against the "
              "pushes the ps applied and dropped as stale; \"ok\": none lost, none applied "
              "twice (a process killed or stopped mid-step may have had one push on its "
              "way); SGP: the messages sent against those taken, and the push-sum mass after "
              "the final average (M when no share was lost or taken twice). One run per "
              "cell." + _load_text(result), ""]
    header = ["strategy", "fault", "ended", "s after the fault (job)", "outcome",
              "accuracy (points)", "updates"]
    rows = []
    for name, runs in result["strategies"].items():
        reference = runs.get("no fault", {}).get("accuracy")
        for scenario, run in runs.items():
            accuracy = run.get("accuracy")
            if accuracy is None:
                accuracy_text = "none"
            elif scenario == "no fault" or reference is None:
                accuracy_text = f"{accuracy:.3f}"
            else:
                accuracy_text = f"{accuracy:.3f} ({100 * (accuracy - reference):+.1f})"
            after = run.get("seconds_after_fault")
            timing = (f"{run['job_seconds']:g}" if after is None
                      else f"{after:g} ({run['job_seconds']:g})")
            rows.append([name, scenario, "yes" if run.get("ended") else "no", timing,
                         _fault_outcome(run), accuracy_text, _fault_updates(run)])
    return parts + [_table(header, rows), ""]


def outer_note(outer):
    """What the "outer" rows of the accuracy table ran (model averaging's outer optimizer)."""
    if outer is None:
        return ""
    config = outer["config"]
    return (f" \"outer\" rows: each round's mean change is a gradient for {outer['class_name']}"
            f" (learning rate {config['learning_rate']:g}, Nesterov momentum "
            f"{config['momentum']:g}) on the ps, DiLoCo's outer step; k=16 exchanges a "
            "model 16x less often than k=1, which exchanges every step as hard sync does.")


def updated_note(modes):
    """Which rows `quality.py --update` measured again, apart from the others."""
    if not modes:
        return ""
    return (f" Measured again later (`quality.py --update`), apart from the other rows: "
            f"{', '.join(modes)}; compare their training seconds with each other only.")


def _with_commit(parts, sources):
    """`parts` (a section: heading, blank, text...) with its commit line after the heading,
    or only the heading and the refusal where its sources mix commits."""
    ok, line = commit_line(sources)
    if not ok:
        return parts[:2] + [line, ""]
    return parts[:2] + [line] + parts[2:]


LIMIT_MODE = "one process, no strategy (limit)"


def scaling_section(scaling, capacity_result, sources):
    """Update rates at each worker count, the one-process limit beside them, the capacity fit."""
    parts = ["## Scaling on this machine and the capacity model", ""]
    modes = [m for m in ("hard sync", "async") if m in scaling]
    limit = scaling.get(LIMIT_MODE, {})
    rows_per = {"hard sync": lambda m: 32 * m, "async": lambda m: 32}
    counts = sorted({int(m) for mode in modes for m in scaling[mode]})
    runs = scaling.get("runs", {})

    def cell(mode, m):
        """"median (min–max)" of a mode's updates/s at m workers (the median alone where
        the file kept no runs)."""
        rates = runs.get(mode, {}).get(str(m))
        if rates:
            return _range(spread(rates))
        rate = scaling.get(mode, {}).get(str(m))
        return "error" if rate is None else f"{rate:.1f}"

    rows = []
    for m in counts:
        row = [m]
        best = limit.get(str(m))
        for mode in modes:
            rate = scaling[mode].get(str(m))
            row.append(cell(mode, m))
            if rate is None:
                row += ["", ""]
                continue
            row.append(f"{rate * rows_per[mode](m):,.0f}")
            row.append("" if not best else f"{rate * rows_per[mode](m) / (best * 32 * m):.2f}")
        if limit:
            row += [cell(LIMIT_MODE, m), "" if best is None else f"{best * 32 * m:,.0f}"]
        rows.append(row)
    parts += [f"Update rates, 1 ps, median (min–max) of {scaling.get('repeats', 1)} "
              "interleaved run(s) per cell; examples/s: the median rate times the rows an "
              "update averages (hard sync: 32 x M, async: 32); \"of the limit\": those "
              "examples per second over one process's (plain Keras `fit`, no strategy, the "
              "same cores) on the global batch of a hard-sync update, 32 x M rows."
              + _load_text(scaling), ""]
    header = ["workers"]
    for mode in modes:
        header += [f"{mode} (updates/s)", "examples/s", "of the limit"]
    if limit:
        header += [f"{LIMIT_MODE} (updates/s)", "examples/s"]
    parts += [_table(header, rows), ""]
    fit = capacity_result["fit"]
    parts += [f"Least-squares fit over the measured worker counts: {1000 * fit['compute_s']:.2f}"
              f" ms per update plus {1000 * fit['per_push_s']:.2f} ms per push. On this "
              "machine the per-push term also holds the sharing of its cores by every process, "
              "so the parameter-server projections below are pessimistic. Check against the "
              "measured hard-sync figures:", ""]
    rows = [[r["workers"], f"{1000 * r['measured_s']:.2f}", f"{1000 * r['predicted_s']:.2f}",
             f"{100 * r['error']:+.0f} %"] for r in capacity_result["local_check"]]
    parts += [_table(["workers", "measured ms/update", "model ms/update", "error"], rows), ""]
    parts += [f"Projection past one machine ({fit['bandwidth_gbit']:g} Gbit/s, "
              f"{fit['latency_us']:g} µs latency, {fit['model_bytes']} model bytes, jitter "
              f"{fit['jitter']:g}, compression x{fit['compression_ratio']:g}, from the "
              "compression benchmark's top-k); the model is documented in "
              "`benchmarks/capacity.py`:", ""]
    projection = capacity_result["projection"]
    keys = [k for k in projection[0] if k != "workers"]
    rows = [[r["workers"]] + [f"{1000 * r[k]:.2f}" for k in keys] for r in projection]
    parts += [_table(["workers"] + [k[:-2].replace("_", " ") + " (ms)" for k in keys], rows), "",
              "![capacity](capacity.png)", ""]
    return _with_commit(parts, sources)


def quality_section(quality):
    parts = ["## Accuracy (digits) against single-process training", "",
             f"{quality['epochs']} epochs, seeds {quality['seeds']}; mean test accuracy "
             "(± its standard deviation over the seeds), "
             "difference to one process in points, mean training seconds."
             + outer_note(quality.get("outer_optimizer"))
             + updated_note(quality.get("updated_modes")) + _load_text(quality), ""]
    single = quality["single process"]
    std = (f" ± {single['test_accuracy_std']:.4f}" if "test_accuracy_std" in single else "")
    rows = [["single process", "1", f"{single['test_accuracy_mean']:.4f}{std}", "",
             f"{single['train_seconds_mean']:.1f}"]]
    sources = {"single process": measured(quality, "single process")}
    for group in (k for k in quality if k.endswith("workers")):
        for name, r in quality[group].items():
            sources[f"{group}/{name}"] = measured(quality, f"{group}/{name}")
            rows.append([name, group.split()[0], f"{r['test_accuracy_mean']:.4f} "
                         f"± {r['test_accuracy_std']:.4f}", f"{r['vs_single_points']:+.2f}",
                         f"{r['train_seconds_mean']:.1f}"])
    parts += [_table(["mode", "workers", "test accuracy", "vs single", "train s"], rows), "",
              "![quality](quality.png)", ""]
    return _with_commit(parts, sources)


def write_report(out_dir, bandwidth_gbit=10.0, latency_us=50.0):
    """Writes `out_dir`/report.md from the JSON there: every section whose JSON is there.

    Args:
      out_dir: the directory of `run_all.py`'s results.
      bandwidth_gbit, latency_us: the network of the capacity projection.
    """

    def _path(name):
        return os.path.join(out_dir, name)

    def _load(name):
        with open(_path(name)) as f:
            return json.load(f)

    parts = ["# tfdist benchmark report", "",
             "Written by `benchmarks/report.py` from the JSON of `benchmarks/run_all.py`. Each "
             "table names the commit and the kind of machine it was measured on (a table "
             "that would mix commits, or timings of two kinds of machine, is refused) and the "
             "workers, model, network and load of its run; each comparison (a ratio, a "
             "fraction of the one-process limit) is between figures of the same run. Compare "
             "those, not absolute times: every process shares its machine's cores.", ""]
    present = {name for name in os.listdir(out_dir) if name.endswith(".json")}
    parts += run_text(out_dir, present)
    if "rates.json" in present:
        parts += rates_section(_load("rates.json"))
    if "straggler.json" in present:
        straggler = _load("straggler.json")
        parts += _with_commit(straggler_section(straggler),
                              {"straggler.json": measured(straggler)})
    if "quality.json" in present:
        parts += quality_section(_load("quality.json"))
    compression = _load("compression.json") if "compression.json" in present else None
    if "scaling.json" in present and compression is not None:
        scaling = _load("scaling.json")
        topk = compression["exchange"]["compressors"].get("topk")
        capacity_result = build_capacity(scaling,
                                         round(topk["bytes_ratio"], 1) if topk else 100.0,
                                         bandwidth_gbit, latency_us)
        # Not a measurement: derived here, from the measurements it names.
        capacity_result["derived_from"] = {
            "scaling.json": {"commit": commit_label(scaling.get("stamp")),
                             "run": (scaling.get("stamp") or {}).get("run")},
            "compression ratio": ({"compression.json top-k": part_commit(compression,
                                                                         "exchange")}
                                  if topk else "a fixed 100 (compression.json has no top-k)")}
        with open(_path("capacity.json"), "w") as f:
            json.dump(capacity_result, f, indent=1)
        plot_capacity(capacity_result, _path("capacity.png"))
        parts += scaling_section(scaling, capacity_result, {
            "scaling.json": measured(scaling),
            "compression.json (top-k ratio)": part_commit(compression, "exchange")})
    if compression is not None:
        parts += ["## Bytes per step", "",
                  f"Dense float32 digits model: {model_bytes()} bytes. A parameter-server "
                  "worker pushes one gradient and reads one model per step (2x that); ring "
                  "all-reduce moves 2(M-1)/M of it per link; a compressed all-gather moves each "
                  "worker's payload to every other.", ""]
        parts += _with_commit(compression_section(compression), {
            part: measured(compression, part) for part in ("exchange", "accuracy")
            if part in compression})
    if "network.json" in present:
        parts += network_section(_load("network.json"))
    if "network_sgp.json" in present:
        sgp = _load("network_sgp.json")
        parts += _with_commit(sgp_network_section(sgp), {
            f"timing/{setting}": measured(sgp, f"timing/{setting}")
            for setting in sgp.get("timing", {})})
    if "faults.json" in present:
        faults = _load("faults.json")
        parts += _with_commit(faults_section(faults),
                              {"faults.json": measured(faults)})
    # `embedding.py --out=results/embedding_<name>`: a run of its own (repeats of one cluster
    # shape, say), a section and a plot of its own.
    for name in sorted(n for n in present if n.startswith("embedding")):
        embedding, plot = _load(name), name[:-len(".json")] + ".png"
        plot_embedding(embedding, _path(plot))
        parts += _with_commit(embedding_section(embedding, plot),
                              {name: measured(embedding)})
    with open(_path("report.md"), "w") as f:
        f.write("\n".join(parts))


def main(argv):
    del argv
    write_report(FLAGS.out_dir, FLAGS.bandwidth_gbit, FLAGS.latency_us)
    print(f"report: {os.path.join(FLAGS.out_dir, 'report.md')}", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
