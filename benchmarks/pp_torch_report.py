"""The report of ``bench_pp_torch``: per-implementation summaries (bubbles against the analytic value and
the jitter model), the pairs ours / torch and the targets, and the printed table."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from benchmarks import common
from benchmarks.bench_pp import LOSS_TOL, WEIGHT_ATOL_IN_LR, WEIGHT_RTOL
from benchmarks.bench_pp import analytic_bubble as analytic
from benchmarks.pp_sim import jitter_bubble

if TYPE_CHECKING:
    from benchmarks.bench_pp_torch import PPTorchConfig


ZERO_BUBBLE_VS = {"zb": "1f1b", "interleaved_zb": "interleaved_1f1b"}  # split backward -> its 1F1B


def action_cv(samples: list[tuple[int, float]], *, warmup: int) -> float:
    """One rank's coefficient of variation of an action's compute time for the jitter model: ``pstdev /
    mean`` of its probe times (``Probe``: ``(step, seconds)``) from step ``warmup`` on.

    An approximation: the probe times a micro-batch's whole forward + backward through the rank's ``v``
    pieces, ``2v`` actions, and across steps. Independent per-action noise averages down in that sum (by
    up to ``sqrt(2v)``), while slow drift over the run (load, clock) adds to it. It is the one chosen as
    the only fluctuation measured on each rank, under the pipeline's conditions (both ranks busy), that
    needs no timer inside the timed schedules."""
    times = [t for s, t in samples if s >= warmup]
    return statistics.pstdev(times) / statistics.fmean(times)


def summarise(
    cfg: PPTorchConfig, impl: str, schedule: str, m: int, rs: list[Any], c: Any, *, cv: dict[int, list[float]]
) -> dict[str, Any]:
    """One implementation: timing (``common.timing``) and, if pipelined, its bubbles (``T``: the median
    over steps of the slowest rank's pipeline part; ``own_T``: each rank's own median), analytic value and
    jitter model (its order with per-action cv ``cv[v]`` per rank)."""
    w, p = cfg.warmup, cfg.world_size
    d: dict[str, Any] = {"impl": impl, "schedule": schedule, "microbatches": m, **common.timing(rs, w)}
    d["losses"] = rs[-1]["losses"]
    if impl == "unpipelined":
        return d
    v = rs[0]["v"]
    span = statistics.median(common.slowest(rs, "phases", "pipeline")[w:])
    own = [statistics.median(r["phases"]["pipeline"][w:]) for r in rs]
    bubble = [1 - m * cr / span for cr in c[v]]
    a = analytic(schedule, p=p, m=m, v=v)
    d.update(virtual_stages=v, stages_per_rank=[r["ids"] for r in rs], compute_per_microbatch_s_per_rank=c[v])
    d.update(pipeline_s=span, pipeline_s_per_rank=own, bubble_per_rank=bubble, bubble_max=max(bubble))
    d.update(
        bubble_mean=statistics.fmean(bubble), bubble_analytic=a, bubble_unit_schedule=rs[0]["unit_bubble"]
    )
    d["bubble_per_rank_own_T"] = [1 - m * cr / t for cr, t in zip(c[v], own, strict=True)]
    d["within_analytic"] = d["bubble_mean"] <= 1.2 * a + 0.03
    jitter = jitter_bubble(rs[0]["orders"], last=p * v - 1, cv=cv[v], seed=cfg.seed)
    d.update(action_cv_per_rank=cv[v], bubble_jitter_model=jitter)
    d["within_jitter_model"] = d["bubble_mean"] <= jitter + 0.03
    if impl == "ours":
        internal = [statistics.median(r["internal_bubble"][w:]) for r in rs]
        d.update(internal_bubble_per_rank=internal, internal_bubble_mean=statistics.fmean(internal))
    return d


def aggregate(cfg: PPTorchConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-implementation timing and bubbles, per-pair comparisons and targets, correctness."""
    w, ms, schedules = cfg.warmup, cfg.microbatch_list(), cfg.schedule_list()
    c = {
        v: [statistics.median(t for s, t in r["probe_samples"][v] if s >= w) for r in per_rank]
        for v in per_rank[0]["probe_samples"]
    }
    cv = {v: [action_cv(r["probe_samples"][v], warmup=w) for r in per_rank] for v in c}
    impls = {
        n: summarise(cfg, impl, s, m, [r["runners"][n] for r in per_rank], c, cv=cv)
        for n, impl, s, m in cfg.impls()
    }
    pairs: dict[str, Any] = {}
    both = [(s, m) for m in ms for s in schedules if f"torch_{s}_m{m}" in impls]
    for o, t in ((impls[f"ours_{s}_m{m}"], impls[f"torch_{s}_m{m}"]) for s, m in both):
        pairs[f"{o['schedule']}_m{o['microbatches']}"] = {
            "time_ours_over_torch": common.time_ratios(o, t, w),
            "ours_le_torch_bubble": o["bubble_mean"] <= t["bubble_mean"],
            "ours_le_torch_time": o["summary"]["median"] <= t["summary"]["median"],
        }
    one_f_one_b: dict[str, bool] = {}
    if {"gpipe", "1f1b"} <= set(schedules):
        for i, m in ((i, m) for i in ("ours", "torch") for m in ms):
            ofo, gp = impls[f"{i}_1f1b_m{m}"]["bubble_mean"], impls[f"{i}_gpipe_m{m}"]["bubble_mean"]
            one_f_one_b[f"{i}_m{m}"] = ofo <= gp
    zero_bubble: dict[str, bool] = {}  # each zero-bubble schedule against the 1F1B it splits
    for zb, ofo in ZERO_BUBBLE_VS.items():
        for i, m in ((i, m) for i in ("ours", "torch") for m in ms):
            a, b = impls.get(f"{i}_{zb}_m{m}"), impls.get(f"{i}_{ofo}_m{m}")
            if a is not None and b is not None:
                zero_bubble[f"{i}_{zb}_m{m}"] = a["bubble_mean"] <= b["bubble_mean"]
    correctness: dict[str, Any] = {}
    for name in (n for n in impls if n in per_rank[0]["correctness"]):
        per = [r["correctness"][name] for r in per_rank]
        correctness[name] = {
            k: {
                "agree": all(x[k]["agree"] for x in per),
                "max_abs_diff": max(x[k]["max_abs_diff"] for x in per),
                "failures": [x[k]["first_failure"] for x in per if x[k]["first_failure"]],
            }
            for k in per[0]
        }
    within = {
        i: all(d["within_analytic"] for d in impls.values() if d["impl"] == i) for i in ("ours", "torch")
    }
    return {
        "implementations": impls,
        "pairs": pairs,
        "compute_per_microbatch_s": {f"v{v}": x for v, x in c.items()},
        "compute_samples_s": {f"v{v}": [r["probe_samples"][v] for r in per_rank] for v in c},
        "action_cv_per_rank": {f"v{v}": x for v, x in cv.items()},
        "targets": {
            "ours_le_torch_bubble": all(q["ours_le_torch_bubble"] for q in pairs.values()),
            "ours_le_torch_time": all(q["ours_le_torch_time"] for q in pairs.values()),
            "1f1b_le_gpipe": one_f_one_b,
            "zb_le_1f1b": zero_bubble,
            "ours_within_analytic": within["ours"],
            "torch_within_analytic": within["torch"],
        },
        "correctness": correctness,
        "correct": bool(correctness) and all(x["agree"] for cs in correctness.values() for x in cs.values()),
        "loss_tol": LOSS_TOL,
        "weight_tol": {"rtol": WEIGHT_RTOL, "atol": WEIGHT_ATOL_IN_LR * cfg.lr},
        "order_rank0": per_rank[0]["order"],
        "loadavg_1min_during_run": common.load_summary(per_rank[0]["loadavg"]),
    }


def pair_row(
    q: dict[str, Any] | None, o: dict[str, Any], t: dict[str, Any] | None, corr: dict[str, Any]
) -> list[str]:
    """One table row: ours ``o`` vs torch's ``t`` (``q`` their comparison, ``corr`` ours' correctness);
    ``-`` in torch's cells where torch has no such schedule (``t`` and ``q`` None)."""
    yn = {True: "y", False: "N"}

    def pair(f: Any) -> str:
        return f"{f(o)}/{f(t) if t is not None else '-'}"

    cells = [
        pair(lambda d: f"{d['summary']['median']:.3f}"),
        f"{q['time_ours_over_torch']['ratio_of_medians']:.2f}" if q is not None else "-",
        pair(lambda d: f"{d['bubble_mean']:.3f}"),
        "|".join("/".join(f"{b:.2f}" for b in d["bubble_per_rank"]) if d else "-" for d in (o, t)),
        f"{o['internal_bubble_mean']:.3f}",
        pair(lambda d: f"{d['bubble_analytic']:.3f}"),
        pair(lambda d: f"{d['bubble_unit_schedule']:.3f}"),
        pair(lambda d: f"{d['bubble_jitter_model']:.3f}"),
        yn[q["ours_le_torch_bubble"]] + "/" + yn[q["ours_le_torch_time"]] if q is not None else "-",
        pair(lambda d: yn[d["within_analytic"]]),
        f"{corr['losses']['max_abs_diff']:.0e}/"
        + (f"{corr['losses_vs_torch']['max_abs_diff']:.0e}" if "losses_vs_torch" in corr else "-"),
    ]
    return [o["schedule"], str(o["microbatches"]), *cells]


def print_table(cfg: PPTorchConfig, result: dict[str, Any]) -> None:
    impls, c, cv = result["implementations"], result["compute_per_microbatch_s"], result["action_cv_per_rank"]
    model = result["model"]
    print(
        f"\np={cfg.world_size}: {model['name']} {model['num_parameters'] / 1e6:.2f}M params (n_layer="
        f"{cfg.n_layer}, n_embd={cfg.n_embd}, seq={cfg.seq}), micro-batch {cfg.micro_batch} rows, "
        f"{cfg.steps} measured + {cfg.warmup} warmup steps; c per micro-batch per rank (ms): "
        + "; ".join(f"{k} " + "/".join(f"{x * 1e3:.1f}" for x in per) for k, per in c.items())
        + "; its cv: "
        + "; ".join(f"{k} " + "/".join(f"{x:.2f}" for x in per) for k, per in cv.items())
        + "\nbubble = 1 - m c / T (mean over ranks), o/t: ours/torch; internal: ours' StepStats; unit: "
        "the order run at unit costs; jitter: at unit costs x lognormal(mean 1, that cv); y/N: targets"
    )
    head = "pair m step_s_o/t o/t bubble_o/t per_rank_o|t internal analytic_o/t unit_o/t jitter_o/t"
    rows = [head.split() + ["o<=t_bub/time", "<=1.2a+.03_o/t", "loss|d|_ref/t"]]
    for name in (n.removeprefix("ours_") for n in impls if n.startswith("ours_")):
        o, t, corr = impls[f"ours_{name}"], impls.get(f"torch_{name}"), result["correctness"][f"ours_{name}"]
        rows.append(pair_row(result["pairs"].get(name), o, t, corr))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(
            " ".join(
                x.rjust(wd) if i else x.ljust(wd) for i, (x, wd) in enumerate(zip(r, widths, strict=True))
            )
        )
    tg, load = result["targets"], result["loadavg_1min_during_run"]
    print(
        f"targets: ours <= torch: bubble {tg['ours_le_torch_bubble']}, step time {tg['ours_le_torch_time']}; "
        "1F1B <= GPipe: "
        + (", ".join(f"{k} {v}" for k, v in tg["1f1b_le_gpipe"].items()) or "-")
        + "; zero bubble <= its 1F1B: "
        + (", ".join(f"{k} {v}" for k, v in tg["zb_le_1f1b"].items()) or "-")
        + f"; <= 1.2 analytic + 0.03: ours {tg['ours_within_analytic']}, torch {tg['torch_within_analytic']}"
    )
    verdict = "agree" if result["correct"] else "DISAGREE"
    print(
        f"correctness (losses vs unpipelined and ours vs torch, final weights): {verdict}; "
        f"1-min load {load['min']:.2f}-{load['max']:.2f}"
    )
