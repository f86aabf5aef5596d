"""Reference numbers from HolisticTraceAnalysis (HTA): which CPU-side range launched each GPU event.

Usage: python hta_reference.py DIR [DIR ...] > expected.json
Each DIR holds one rank-0 trace file (HTA's TraceAnalysis expects one directory per trace).
Set HTA_COMMIT to record the commit of the HTA source being imported. expected.json was made with:
  G=/work/.mirror/facebookresearch+HolisticTraceAnalysis/repo; mkdir -p mirror && git --git-dir=$G archive HEAD hta | tar -x -C mirror
  HTA_COMMIT=$(git --git-dir=$G rev-parse HEAD) PYTHONPATH=/tmp/htaref/mirror /tmp/htavenv/bin/python hta_reference.py \
    traces/alexnet traces/triton traces/sampled traces/simple_add > expected.json
(without PYTHONPATH it uses the pip-installed HTA 0.5.0; its CallGraph needs numpy<2, hence pandas 2.2.3/numpy 1.26.4 in the venv)
"""
import gzip
import inspect
import json
import logging
import os
import sys
from collections import defaultdict

import hta.version
from hta.common.trace_call_graph import CallGraph
from hta.trace_analysis import TraceAnalysis

logging.disable(logging.WARNING)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RANGE_CATS = ("cpu_op", "user_annotation")


def bucket(rows):
    out = defaultdict(lambda: {"kernels": 0, "us": 0.0, "us_raw": 0.0})
    for key, dur, raw in rows:
        b = out[key]
        b["kernels"] += 1
        b["us"] += float(dur)
        b["us_raw"] += raw
    return dict(sorted(out.items()))


def ancestors(df, idx):
    """HTA call-stack ancestors of event idx, innermost first (parent < 0 = thread root)."""
    p = int(df.at[idx, "parent"])
    while p >= 0:
        yield p
        p = int(df.at[p, "parent"])


def analyse(trace_dir, include_last_profiler_step=False):
    fname = os.listdir(trace_dir)[0]
    with gzip.open(os.path.join(trace_dir, fname)) as f:
        raw_ev = json.load(f)["traceEvents"]
    raw_dur = {(e["cat"], e["args"]["correlation"]): e["dur"] for e in raw_ev
               if e.get("cat") in GPU_CATS and "correlation" in e.get("args", {})}

    ta = TraceAnalysis(trace_dir=trace_dir, include_last_profiler_step=include_last_profiler_step)
    t = ta.t
    # API 1: GPU kernels <-> GPU-side user annotations (kwarg was misspelt 'shortern_names' before 0.6)
    kw = "shorten_names" if "shorten_names" in inspect.signature(
        ta.get_gpu_kernels_with_user_annotations).parameters else "shortern_names"
    ka = ta.get_gpu_kernels_with_user_annotations(rank=0, expand_names=True, **{kw: False})

    # API 2: HTA call graph -> adds parent/depth columns; a GPU event's parent is its launch
    CallGraph(t, ranks=[0])
    df = t.get_trace(0)
    sym = t.symbol_table.get_sym_table()
    cat = df["cat"].map(lambda i: sym[i])
    name = df["name"].map(lambda i: sym[i])
    gpu = df[cat.isin(GPU_CATS)]

    by_parent, by_ua_in, by_ua_out, unmatched, launches = [], [], [], 0, defaultdict(int)
    for idx, row in gpu.iterrows():
        raw = raw_dur.get((cat[idx], int(row["correlation"])), float("nan"))
        launch = int(row["parent"])
        if launch < 0 or int(row["index_correlation"]) <= 0:
            unmatched += 1
            by_parent.append(("<unmatched>", row["dur"], raw))
            continue
        launches[name[launch]] += 1
        anc = list(ancestors(df, launch))
        rng = [a for a in anc if cat[a] in RANGE_CATS]
        uas = [a for a in anc if cat[a] == "user_annotation"]
        by_parent.append((name[rng[0]] if rng else "<no enclosing range>", row["dur"], raw))
        by_ua_in.append((name[uas[0]] if uas else "<none>", row["dur"], raw))
        by_ua_out.append((name[uas[-1]] if uas else "<none>", row["dur"], raw))

    by_ua = None
    if ka is not None:
        ka = ka[ka["s_cat"].isin(GPU_CATS)]
        by_ua = bucket((r.s_user_annotation or "<none>", r.dur,
                        raw_dur.get((r.s_cat, r.correlation), float("nan"))) for r in ka.itertuples())
    return {
        "hta_load": {"TraceAnalysis.include_last_profiler_step": include_last_profiler_step},
        "kernels": len(gpu), "kernel_us": float(gpu["dur"].sum()),
        "kernel_us_raw": float(sum(r for _, _, r in by_parent)),
        "by_category": bucket((cat[i], d, raw_dur.get((cat[i], int(c)), float("nan")))
                              for i, d, c in zip(gpu.index, gpu["dur"], gpu["correlation"])),
        "user_annotation_rule": "get_gpu_kernels_with_user_annotations: innermost (shortest) GPU-side "
                                "'gpu_user_annotation' overlapping the event on the same pid/tid; "
                                "covers kernel+gpu_memcpy+gpu_memset (+cuda_sync); None if no gpu_user_annotation",
        "by_user_annotation": by_ua,
        "by_launch_parent_cpu_op": bucket(by_parent),
        "by_launch_user_annotation_innermost": bucket(by_ua_in),
        "by_launch_user_annotation_outermost": bucket(by_ua_out),
        "launch_names": dict(launches),
        "unmatched": unmatched,
    }


if __name__ == "__main__":
    out = {}
    for d in sys.argv[1:]:
        res = analyse(d)
        alt = analyse(d, include_last_profiler_step=True)
        res["with_include_last_profiler_step_true"] = {
            k: alt[k] for k in ("kernels", "kernel_us", "kernel_us_raw", "unmatched")}
        out[os.listdir(d)[0]] = {"hta_commit": os.environ.get("HTA_COMMIT", "unknown"),
                                 "hta_version": ".".join(map(str, hta.version.__version_tuple__)), **res}
    json.dump(out, sys.stdout, indent=1)
    print()
