"""One command for every benchmark of this repository, and one readable report.

    python benchmarks/report.py            # CI-sized settings, a few minutes
    python benchmarks/report.py --full     # the settings the issues ask for (about an hour)
    python benchmarks/report.py --reuse    # rebuild the report from the JSON already there

Writes into --out_dir: rates.json, straggler.{json,png}, quality.{json,png}, scaling.json,
capacity.{json,png}, compression.{json,png}, embedding.{json,png} and report.md, which shows
the tables and plots side by side with the TF built-ins measured in the same run (where they run).
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import capacity  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("full", False, "Full settings (3 seeds, 4 and 8 workers, 20 epochs).")
flags.DEFINE_bool("reuse", False, "Use the JSON results already in --out_dir where present.")
flags.DEFINE_string("out_dir", os.path.join("benchmarks", "results"), "Where results go.")
flags.DEFINE_float("bandwidth_gbit", 10.0, "Network bandwidth of the capacity projection.")
flags.DEFINE_float("latency_us", 50.0, "Network latency of the capacity projection.")
flags.DEFINE_float("run_timeout", 3600.0, "Seconds each benchmark may take.")
flags.DEFINE_string("peer_python", None, "Python of an environment with tensorflow and "
                    "tf_keras, for the ParameterServerStrategy rows of the rates and "
                    "embedding tables (benchmarks/tf_keras_peer.py).")


def _path(name):
    return os.path.join(FLAGS.out_dir, name)


def _run(script, *args):
    command = [sys.executable, os.path.join(HERE, script), *args]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, timeout=FLAGS.run_timeout)


def _load(name):
    with open(_path(name)) as f:
        return json.load(f)


RESULTS = ("rates.json", "straggler.json", "quality.json", "scaling.json", "compression.json",
           "network.json", "embedding.json")
MEASURED = set()  # what this run measured


def _needed(name):
    needed = not (FLAGS.reuse and os.path.exists(_path(name)))
    if needed:
        MEASURED.add(name)
    return needed


def measure_scaling(worker_counts, window):
    """Hard-sync and async update rates at each worker count (1 ps)."""
    from tfdist.launch import LocalCluster

    results = {}
    for mode, strategy_flags in (("hard sync", ["--strategy=soft_sync"]),
                                 ("async", ["--strategy=async"])):
        results[mode] = {}
        for m in worker_counts:
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, os.path.join(HERE, "ps_worker.py"),
                           f"--out_dir={out}", f"--window={window}", *strategy_flags]
                with LocalCluster(command, num_ps=1, num_workers=m, output=None,
                                  timeout=FLAGS.run_timeout) as cluster:
                    result = cluster.wait()
                if result.returncode:
                    raise RuntimeError(f"{mode} on {m} workers failed: {result.message}")
                with open(os.path.join(out, "rate.json")) as f:
                    results[mode][m] = json.load(f)["updates_per_second"]
            print(f"scaling: {mode}, {m} workers: {results[mode][m]:.1f} updates/s", flush=True)
    return results


def model_bytes():
    # The digits MLP of the benchmarks: 64 -> 64 -> 10, float32.
    parameters = 64 * 64 + 64 + 64 * 10 + 10
    return 4 * parameters


def build_capacity(scaling, compression_ratio):
    rates = {int(m): r for m, r in scaling["hard sync"].items()}
    compute_s, per_push_s = capacity.fit_local(rates)
    model = capacity.CapacityModel(
        compute_s=compute_s, per_push_s=per_push_s, model_bytes=model_bytes(),
        bandwidth_bytes_s=FLAGS.bandwidth_gbit * 1e9 / 8, latency_s=FLAGS.latency_us * 1e-6,
        compression_ratio=compression_ratio)
    workers = [8, 16, 32, 64, 128, 256, 512, 1024]
    return {"fit": {"compute_s": compute_s, "per_push_s": per_push_s,
                    "model_bytes": model.model_bytes, "bandwidth_gbit": FLAGS.bandwidth_gbit,
                    "latency_us": FLAGS.latency_us, "jitter": model.jitter,
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


def compression_section(result):
    exchange, accuracy = result["exchange"], result["accuracy"]
    parts = ["## Compressed gradient exchange", "",
             "`benchmarks/compression.py`: one process, 2 replicas on 2 logical CPU devices. "
             f"Step time of `CompressedMirroredStrategy(compression=None)` over TF's "
             f"`MirroredStrategy` on the same job (MLP, {exchange['model_parameters']:,} "
             f"parameters, interleaved runs, median): **{exchange['step_time_ratio']:.3f}** "
             "(target ≤ 1.03).", "",
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
             "ring all-reduce's over it.", ""]
    timing = result.get("timing", {})
    settings = sorted(timing)
    if settings:
        names = list(next(iter(timing.values())))
        header = ["compressor"] + [f"{s}: s/step (speed-up)" for s in settings]
        by_n = {}
        for setting in settings:
            by_n.setdefault(setting.split("N=")[1], setting)
        header += [f"wire bytes, ratio (N={n})" for n in by_n]
        rows = []
        for name in names:
            row = [name]
            for setting in settings:
                r = timing[setting].get(name, {})
                row.append(f"{r['seconds_per_step']:.3f} ({r.get('speedup', 0):.1f}x)"
                           if "seconds_per_step" in r else "error" if r else "")
            for setting in by_n.values():
                r = timing[setting].get(name, {})
                row.append(f"{int(r['bytes_on_wire']):,}, {r['compression_ratio']:.1f}x"
                           if "bytes_on_wire" in r else "")
            rows.append(row)
        parts += [_table(header, rows), ""]
    accuracy = result.get("accuracy", {})
    if accuracy:
        setting = result["accuracy_setting"]
        parts += [f"Digits test accuracy after {setting['epochs']} epochs, N = "
                  f"{setting['workers']} (network: {setting['bandwidth'] or 'no limit'}; one "
                  "seed), and points against uncompressed:", ""]
        rows = [[name, f"{r['test_accuracy']:.4f}" if "test_accuracy" in r else "error",
                 f"{100 * r['accuracy_difference']:+.1f}" if "accuracy_difference" in r else "",
                 f"{r['loss'][-1]:.3f}" if r.get("loss") else ""]
                for name, r in accuracy.items()]
        parts += [_table(["compressor", "test accuracy", "points", "final loss"], rows), ""]
    parts += ["![network](network.png)", ""]
    return parts


def sgp_network_section(result):
    """Stochastic Gradient Push against uncompressed all-reduce on a rate-limited network
    (`benchmarks/network.py --sgp`, its own run)."""
    parts = ["## Stochastic Gradient Push on a slow network", "",
             f"`benchmarks/network.py --sgp --compressors=none`: {result['job']}; "
             f"{result['network']}; {result['machine']}. Median seconds per step of the chief "
             f"over {result.get('timing_steps', '?')} steps, both rows in the same run; "
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
            rows.append([setting, label,
                         f"{r['seconds_per_step']:.3f}" if "seconds_per_step" in r else
                         (r.get("error", "")[:80] or ""),
                         f"{r['speedup']:.2f}x" if "speedup" in r else "",
                         f"{int(r['bytes_on_wire']):,} ({r['compression_ratio']:.2f}x)"
                         if "bytes_on_wire" in r else ""])
    return parts + [_table(["network, N", "strategy", "s/step", "speed-up", "wire bytes/step"],
                           rows), ""]


def rates_section(rates):
    parts = ["## Update rates, every strategy on one job", "",
             f"{rates['num_workers']} workers, {rates['job']}, {rates['network']}; global "
             f"updates per second on the chief over {rates['window_seconds']:g} s windows, "
             f"median of {rates['repeats']} interleaved runs. Ratios are to tfdist's "
             "MultiWorkerMirrored (all-reduce) and, for async, to tf_keras `fit` under TF's "
             "ParameterServerStrategy (its async training) at the same steps_per_execution."
             + _load_text(rates), ""]
    rows = []
    for name, row in rates["rows"].items():
        rate = row["updates_per_second"]
        peer = row.get("ratio_to_tf_keras_pss")
        runs = " / ".join(f"{run['updates_per_second']:.1f}" if "updates_per_second" in run
                          else "error" for run in row.get("runs", []))
        rows.append([name, "error" if rate is None else f"{rate:.1f}", runs,
                     f"{row['ratio_to_mwms']:.2f}" if "ratio_to_mwms" in row else "",
                     f"{peer:.2f}" if peer else ""])
    parts += [_table(["mode", "updates/s", "each run", "vs all-reduce", "vs tf_keras PSS"],
                     rows), ""]
    held = ", ".join(f"{k}: {' / '.join(str(b) for b in v)} bytes"
                     for k, v in rates["bytes_per_ps_task"].items())
    parts += [f"Bytes one push of a worker carries to each ps task (its reply carries as "
              f"much back), as the runs placed the model: {held}.", ""]
    sent = {name: row["bytes_sent_per_worker_step"] for name, row in rates["rows"].items()
            if "bytes_sent_per_worker_step" in row}
    if sent:
        parts += ["Bytes an SGP worker sends per step (its messages, one per out-peer): "
                  + ", ".join(f"{name}: {b:,.0f}" for name, b in sent.items()) + ".", ""]
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


def embedding_section(result):
    """Tables on the ps (`benchmarks/embedding.py`): rate, bytes, memory and accuracy of
    every system against V."""
    settings, commit, machine = result["settings"], result["commit"], result["machine"]
    mib = 1 / 2**20
    parts = ["## Embedding tables: a recommendation job against V", "",
             f"`benchmarks/embedding.py`: {settings['job']} Batch {settings['batch_size']} per "
             f"worker step, steps_per_execution {settings['steps_per_execution']} for every "
             f"system; tfdist `embedding_tables={settings['embedding_tables']}` where the "
             "strategy takes it (else every worker mirrors every table). Median (min-max) of "
             f"{settings['repeats']} interleaved runs, {settings['window']:g} s windows after "
             f"{settings['warmup']:g} s; an update is one change of the ps variables (hard sync:"
             " one per `workers` pushes); examples/s = pushes x batch. Bytes: the cluster's "
             "private loopback over the window per worker step, both ways, headers included. "
             "Memory: the largest peak resident set (VmHWM) of a worker, of a ps task. Accuracy"
             f" and loss: on 20,000 held-out examples after {settings['quality_examples']:,} "
             "training examples, points against one process at the same V (hard sync takes "
             "one update per `workers` batches: after the same examples, that many times fewer"
             " updates). Commit "
             f"{commit['sha'][:10]}{' (dirty tree)' if commit['dirty'] else ''}; "
             f"{machine['cpus']} cores, {machine['memory_bytes'] / 2**30:.0f} GiB."
             + _load_text(result), ""]
    rows = [[f"{int(v):,}", f"{e['parameters']:,}",
             f"{sum(e['unique_rows_per_batch'].values()):,.0f}",
             f"{e['rows_only_bytes_per_worker_step']:,.0f}",
             f"{e['whole_model_bytes_per_worker_step']:,.0f}"]
            for v, e in result["estimates"].items()]
    parts += ["Estimates (payload only) of one worker step's bytes: rows only (the rows a batch "
              "touches read, their gradients and ids pushed, the dense part both ways) and the"
              " whole model both ways:", "",
              _table(["V", "parameters", "distinct rows / batch", "rows only (bytes)",
                      "whole model (bytes)"], rows), ""]
    series = _embedding_series(result)
    one = {c["rows"]: c for c in result["cells"] if c["system"] == "one_process"}
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
            base = one.get(cell["rows"], {}).get("accuracy")
            points = (f" ({100 * (accuracy['median'] - base['median']):+.1f})"
                      if accuracy and base and cell["system"] != "one_process" else "")
            rows.append([label, workers, num_ps or "", f"{cell['rows']:,}",
                         _spread(cell.get("updates_per_second")), _spread(rate, digits=0),
                         f"{rate['median'] / peer['median']:.2f}x"
                         if rate and peer and cell["system"] != "peer" else "",
                         f"{rate['median'] / first['median']:.2f}x" if rate and first else "",
                         _spread(cell.get("bytes_per_worker_step"), digits=0),
                         _spread(cell.get("worker_peak_bytes"), mib, 0),
                         _spread(cell.get("ps_peak_bytes"), mib, 0),
                         _spread(accuracy, digits=3) + points, _spread(cell.get("loss"),
                                                                      digits=3),
                         f"{errors} of {len(cell['runs'])}" if errors else ""])
    parts += [_table(["system", "workers", "ps", "V", "updates/s", "examples/s", "vs peer",
                      "vs smallest V", "bytes / worker step", "worker peak MiB", "ps peak MiB",
                      "accuracy (points vs one process)", "loss", "failed runs"], rows), "",
              "![embedding](embedding.png)", ""]
    return parts


def plot_embedding(result, path):
    """Examples per second and a worker's peak memory against V (log x), one line per
    system, workers and ps; bars from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for (label, workers, num_ps), cells in _embedding_series(result).items():
        name = label if label.startswith("one process") else f"{label}, {workers} w, {num_ps} ps"
        for ax, key, scale in ((rate_ax, "examples_per_second", 1.0),
                               (memory_ax, "worker_peak_bytes", 1 / 2**20)):
            points = [(c["rows"], c[key]) for c in cells if c.get(key)]
            if not points:
                continue
            x = [v for v, _ in points]
            y = [scale * f["median"] for _, f in points]
            error = [[scale * (f["median"] - f["min"]) for _, f in points],
                     [scale * (f["max"] - f["median"]) for _, f in points]]
            ax.errorbar(x, y, yerr=error, marker="o", capsize=3, label=name)
    for ax, ylabel in ((rate_ax, "examples / s (all workers)"),
                       (memory_ax, "peak resident memory of a worker (MiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("V (rows of the large table)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    rate_ax.set_yscale("log")
    rate_ax.legend(fontsize=7)
    fig.suptitle("Embedding tables: rate and worker memory against V")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _load_text(results):
    """The load average a benchmark recorded, for its section's header."""
    if "load_before" not in results:
        return ""
    before, after = (results[k]["load_average_1_5_15"] for k in ("load_before", "load_after"))
    return (f" Load average (1 / 5 / 15 min) {' / '.join(f'{x:g}' for x in before)} at the "
            f"start, {' / '.join(f'{x:g}' for x in after)} at the end, on "
            f"{results['load_before']['cpus']} cores shared with other jobs.")


def straggler_section(straggler):
    every = straggler.get("stall_every")
    scenarios = straggler.get("scenarios", ["persistent"])
    parts = ["## Update rate with stragglers", "",
             f"1 ps + {straggler['num_workers']} workers (all-reduce, SGP: no ps), digits MLP "
             "64-64-10, batch 32 per worker, localhost, no bandwidth limit. Rate = chief's "
             f"global steps per second over {straggler['window_seconds']:g} s; ratio = rate "
             "with the straggler / rate without, one run each. Persistent: the last worker "
             f"{straggler['slowdown']:g}x slower at every step."
             + (f" Transient: the last worker stalls for {straggler['stall_steps']:g} of its "
                f"step times once every {every} steps. Rotating: every worker stalls so, in "
                "turn. \"paid\": the ratio if everyone paid every stall in full, K t / (K t + n d) "
                "(t: the chief's step time without straggler, n stalls of d seconds per K "
                "steps), what a barrier (hard sync, all-reduce) pays; for soft sync and async, "
                "whose t is not a worker's step, only a scale. On 2 shared cores a stalled "
                "worker also frees a core for the others: ratios above 1 are that and noise."
                if len(scenarios) > 1 else "")
             + _load_text(straggler), ""]
    header = ["mode", "no straggler (updates/s)"]
    for scenario in scenarios:
        header += [f"{scenario} (updates/s)", "ratio"]
        if scenario != "persistent":
            header.append("paid")
    rows = []
    for name, r in straggler["modes"].items():
        if "updates_per_second" not in r.get("baseline", {}):
            rows.append([name, "does not run: " + r.get("error", "")[:120]]
                        + [""] * (len(header) - 2))
            continue
        row = [name, f"{r['baseline']['updates_per_second']:.1f}"]
        for scenario in scenarios:
            if scenario == "persistent":
                done = {"run": r["straggler"], **r} if "rate_ratio" in r else {}
            else:
                done = r.get(scenario, {})
            if "rate_ratio" in done:
                row += [f"{done['run']['updates_per_second']:.1f}", f"{done['rate_ratio']:.2f}"]
            else:
                row += ["error", (done.get("error") or r.get("error") or "")[:60]]
            if scenario != "persistent":
                row.append(f"{done['ratio_if_paid']:.2f}" if "ratio_if_paid" in done else "")
        rows.append(row)
    return parts + [_table(header, rows), "", "![straggler](straggler.png)", ""]


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


def write_report(straggler, quality, scaling, capacity_result, compression, rates=None):
    parts = ["# tfdist benchmark report", "",
             f"Settings: {'full' if FLAGS.full else 'CI-sized (fast)'}; each section names the "
             "workers, model and network of its own table. Every figure was "
             "measured on this machine (2 cores); each comparison (a ratio, a difference to one "
             "process) is between figures of the same benchmark run. Compare those, not "
             "absolute times: workers, ps and launcher share this machine's cores.", ""]
    reused = [name for name in RESULTS if FLAGS.reuse and name not in MEASURED]
    if reused:
        parts += ["Not re-measured by this run (`--reuse`: the JSON already there, from an "
                  f"earlier run; see its commit): {', '.join(reused)}.", ""]
    if rates is not None:
        parts += rates_section(rates)
    parts += straggler_section(straggler)
    parts += ["## Accuracy (digits) against single-process training", "",
              f"{quality['epochs']} epochs, seeds {quality['seeds']}; mean test accuracy, "
              "difference to one process in points, mean training seconds."
              + outer_note(quality.get("outer_optimizer"))
              + updated_note(quality.get("updated_modes")), ""]
    single = quality["single process"]
    rows = [["single process", "1", f"{single['test_accuracy_mean']:.4f}", "",
             f"{single['train_seconds_mean']:.1f}"]]
    for group in (k for k in quality if k.endswith("workers")):
        for name, r in quality[group].items():
            rows.append([name, group.split()[0], f"{r['test_accuracy_mean']:.4f} "
                         f"± {r['test_accuracy_std']:.4f}", f"{r['vs_single_points']:+.2f}",
                         f"{r['train_seconds_mean']:.1f}"])
    parts += [_table(["mode", "workers", "test accuracy", "vs single", "train s"], rows), "",
              "![quality](quality.png)", ""]
    parts += ["## Scaling on this machine and the capacity model", ""]
    modes = list(scaling)
    counts = sorted({int(m) for mode in modes for m in scaling[mode]})
    rows = [[m] + [f"{scaling[mode].get(str(m), scaling[mode].get(m, float('nan'))):.1f}"
                   for mode in modes] for m in counts]
    parts += [_table(["workers"] + [f"{mode} (updates/s)" for mode in modes], rows), ""]
    fit = capacity_result["fit"]
    parts += [f"Least-squares fit over the measured worker counts: {1000 * fit['compute_s']:.2f}"
              f" ms per update plus {1000 * fit['per_push_s']:.2f} ms per push. On this "
              "machine the per-push term also holds the sharing of 2 cores by every process, "
              "so the parameter-server projections below are pessimistic. Check against the "
              "measured hard-sync figures:", ""]
    rows = [[r["workers"], f"{1000 * r['measured_s']:.2f}", f"{1000 * r['predicted_s']:.2f}",
             f"{100 * r['error']:+.0f} %"] for r in capacity_result["local_check"]]
    parts += [_table(["workers", "measured ms/update", "model ms/update", "error"], rows), ""]
    parts += [f"Projection past one machine ({fit['bandwidth_gbit']:g} Gbit/s, "
              f"{fit['latency_us']:g} µs latency, {fit['model_bytes']} model bytes, jitter "
              f"{fit['jitter']:g}, compression x{fit['compression_ratio']:g}); the model is "
              "documented in `benchmarks/capacity.py`:", ""]
    projection = capacity_result["projection"]
    keys = [k for k in projection[0] if k != "workers"]
    rows = [[r["workers"]] + [f"{1000 * r[k]:.2f}" for k in keys] for r in projection]
    parts += [_table(["workers"] + [k[:-2].replace("_", " ") + " (ms)" for k in keys], rows), "",
              "![capacity](capacity.png)", ""]
    parts += ["## Bytes per step", "",
              f"Dense float32 digits model: {model_bytes()} bytes. A parameter-server worker "
              "pushes one gradient and reads one model per step (2x that); ring all-reduce "
              "moves 2(M-1)/M of it per link; a compressed all-gather moves each worker's "
              "payload to every other. The capacity projection's compressed all-gather uses "
              f"the top-k ratio measured below (x{capacity_result['fit']['compression_ratio']:g})"
              ".", ""]
    parts += compression_section(compression)
    if os.path.exists(_path("network.json")):
        parts += network_section(_load("network.json"))
    if os.path.exists(_path("network_sgp.json")):
        parts += sgp_network_section(_load("network_sgp.json"))
    if os.path.exists(_path("embedding.json")):
        embedding = _load("embedding.json")
        plot_embedding(embedding, _path("embedding.png"))
        parts += embedding_section(embedding)
    with open(_path("report.md"), "w") as f:
        f.write("\n".join(parts))


def main(argv):
    del argv
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    if _needed("rates.json"):
        _run("rates.py", f"--out={_path('rates')}",
             *(["--num_workers=4"] if FLAGS.full else ["--num_workers=2", "--repeats=1",
                                                      "--window=3", "--warmup=2"]),
             *([f"--peer_python={FLAGS.peer_python}"] if FLAGS.peer_python else []))
    if _needed("straggler.json"):
        _run("straggler.py", f"--out={_path('straggler')}",
             *(["--num_workers=4", "--window=10"] if FLAGS.full
               else ["--num_workers=3", "--window=4"]))
    if _needed("quality.json"):
        _run("quality.py", f"--out={_path('quality')}",
             *([] if FLAGS.full else ["--seeds=1", "--workers=2", "--epochs=3",
                                      "--modes=hard sync,async inverse,averaging k=4"]))
    if _needed("scaling.json"):
        scaling = measure_scaling([1, 2, 4, 8] if FLAGS.full else [1, 2, 3],
                                  10.0 if FLAGS.full else 3.0)
        with open(_path("scaling.json"), "w") as f:
            json.dump(scaling, f, indent=1)
    if _needed("compression.json"):
        _run("compression.py", f"--out={_path('compression')}",
             *([] if FLAGS.full else ["--fast"]))
    if _needed("network.json"):
        _run("network.py", f"--out={_path('network')}",
             *([] if FLAGS.full else ["--compressors=none,fp16,topk,powersgd", "--workers=2",
                                      "--bandwidths=100mbit", "--epochs=3",
                                      "--timing_steps=10", "--nowithout_error_feedback"]))
    if _needed("embedding.json"):
        _run("embedding.py", f"--out={_path('embedding')}", *([] if FLAGS.full else ["--quick"]),
             *([f"--peer_python={FLAGS.peer_python}"] if FLAGS.peer_python else []))
    compression = _load("compression.json")
    topk = compression["exchange"]["compressors"].get("topk")
    scaling = _load("scaling.json")
    capacity_result = build_capacity(scaling, round(topk["bytes_ratio"], 1) if topk else 100.0)
    with open(_path("capacity.json"), "w") as f:
        json.dump(capacity_result, f, indent=1)
    plot_capacity(capacity_result, _path("capacity.png"))
    write_report(_load("straggler.json"), _load("quality.json"), scaling, capacity_result,
                 compression, _load("rates.json"))
    print(f"report: {_path('report.md')}", flush=True)


if __name__ == "__main__":
    app.run(main)
