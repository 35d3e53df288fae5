"""`bench_pause.py`'s analysis: the stall and the phases of each update from the recorded events
and token times, their summary per pause mode, and the report's table."""

from __future__ import annotations

import statistics

TARGET_S = 0.020
"""The stall may exceed the push by at most this."""
PHASES = ("lead_in", "pause", "to_push", "push", "to_rpc_return", "reset_prefix_cache", "resume",
          "to_first_token")



def gap_around(times: list[float], t: float) -> tuple[float, float] | None:
    """(last arrival <= t, first arrival > t) in sorted `times`, or None."""
    import bisect

    i = bisect.bisect_right(times, t)
    return (times[i - 1], times[i]) if 0 < i < len(times) else None


def gap_sources(a: float, g: float, times: list[float], baseline: tuple[float, float],
                probes: dict) -> dict:
    """Which process held up the longest token gap [a, a + g] (probes: `bench_pause.Probes`):
    the engine core's own steps inside it (a core that kept stepping leaves the gap to the front
    end), the longest interval between its steps around it, the front end's lag behind the core
    and its garbage collections; and the longest gap of undisturbed decoding (`baseline`)."""
    import bisect

    lo, hi = bisect.bisect_left(times, baseline[0]), bisect.bisect_right(times, baseline[1])
    base = times[lo:hi]
    bg, b = max(((y - x, x) for x, y in zip(base, base[1:])), default=(None, None))
    core = sorted(probes["core"])
    made = [c for c, _ in core]
    # its steps within 0.1 s of the gap, and the last one before it and the first after it
    # (on a slow host a step may take longer than that)
    i, j = bisect.bisect_right(made, a) - 1, bisect.bisect_left(made, a + g)
    near = sorted({c for c in made if a - 0.1 < c < a + g + 0.1}
                  | {made[k] for k in (i, j) if 0 <= k < len(made)})
    firsts = probes.get("firsts", [])

    def begun(end: float) -> int:  # requests whose first token came with the gap's end
        return sum(abs(f - end) < 0.003 for f in firsts)

    return {
        "baseline_max_gap_s": bg,
        "requests_begun_at_gap_end": begun(a + g),
        "requests_begun_at_baseline_gap_end": None if bg is None else begun(b + bg),
        "gap_windows": [[a, a + g], [b, b + bg] if bg is not None else [0.0, 0.0]],
        "core_steps_in_gap": sum(a < c < a + g for c in made),
        "core_max_interval_near_gap_s": max((y - x for x, y in zip(near, near[1:])),
                                            default=None),
        "frontend_lag_in_gap_s": max((s - c for c, s in core if a < s <= a + g + 0.002),
                                     default=None),
        "frontend_gcs_in_gap": [[round(t - a, 4), round(d, 4), int(gen)]
                                for t, d, gen in probes["gcs"] if t < a + g and t + d > a],
        "frontend_stalls_in_gap": [[round(t - a, 4), round(d, 4)]
                                   for t, d in probes.get("frontend_stalls", ())
                                   if t < a + g and t + d > a],
        "engine_stalls_in_gap": [[round(t - a, 4), round(d, 4), where]
                                 for t, d, where in probes.get("stalls", ())
                                 if t < a + g and t + d > a],
    }


def analyse(u: dict, ev: dict[str, dict], tokens: list[tuple[float, int]], clients: int,
            requests: list[tuple[float, float, str]], baseline: tuple[float, float],
            probes: dict | None = None) -> dict:
    """The stall and where it went, for one update whose calls are `ev`.

    Paused modes: the stall is the token gap around the push's start. Beside serving
    (`beside:<mode>`): around the pause for the swap; then also the decode rate while the update
    was received (push start -> pause) against undisturbed decoding (`baseline`), and the
    requests that spanned the swap (`wait` promises none); with `probes`, where the longest gap
    came from (`gap_sources`)."""
    times = sorted(t for t, _ in tokens)
    beside = u["mode"].startswith("beside:")
    push = ev["push"]
    rpc = (ev.get("rpc:nccl_sync_swap_carry") or ev.get("rpc:nccl_sync_swap")) if beside else \
        ev.get("rpc:nccl_sync_receive")
    pause, reset, resume = ev.get("pause"), ev.get("reset_prefix_cache"), ev.get("resume")
    hold = pause or (rpc if beside else None)  # `carry` never pauses: the swap's own call
    at = hold["t0"] if beside and hold else push["t0"]
    gap = gap_around(times, at)
    out = {**u, "push_s": push["t1"] - push["t0"], "push_reported_s": push["reported_s"],
           "buckets": push["buckets"], "rpc_s": rpc and rpc["t1"] - rpc["t0"],
           "rx_s": rpc and [s.get("seconds") for s in rpc["result"]],
           "carry": rpc and [s.get("carry") for s in rpc["result"] if s.get("carry")],
           "calls": sorted(ev),
           "tokens_during_push": sum(push["t0"] < t < push["t1"] for t in times)}
    if gap is None:
        out["error"] = "no token before or after the push"
        return out
    stop, go = gap

    def span(a: dict | None, ka: str, b: dict | None, kb: str) -> float | None:
        return None if a is None or b is None else b[kb] - a[ka]

    edge = {"t0": stop, "t1": go}  # the stall's ends, as pseudo-events
    out["stall_s"] = go - stop
    import bisect

    end = resume or (rpc if beside else None) or push
    lo, hi = bisect.bisect_left(times, push["t0"]), bisect.bisect_right(times, end["t1"])
    window = times[max(lo - 1, 0):hi + 1]
    gaps = [(b - a, a) for a, b in zip(window, window[1:])]
    out["max_gap_s"] = max(gaps)[0] if gaps else None
    if gaps:  # where it was: from the push's start, and from the pause
        g, a = max(gaps)
        out["max_gap_from_push_s"] = a - push["t0"]
        out["max_gap_from_pause_s"] = a - hold["t0"] if hold else None
        if probes is not None:
            out.update(gap_sources(a, g, times, baseline, probes))
        side = (rpc or {}).get("result") or [{}]
        seen = side[0].get("beside") if isinstance(side[0], dict) else None
        if beside and seen:  # the worker's steps and garbage collections, from the gap's start
            out["worker_marks_from_gap_s"] = {k: round(v - a, 4) for k, v in seen["marks"].items()}
            if "started" in (side[0].get("carry") or {}):  # the engine core's prefix-cache drop
                out["worker_marks_from_gap_s"]["drop"] = round(side[0]["carry"]["started"] - a, 4)
            out["worker_gcs_near_gap"] = [[round(t - a, 4), round(d, 4), gen]
                                          for t, d, gen in seen["gc"]
                                          if a - 0.05 < t < a + g and d > 0.005]
            out["worker_gc_s"] = round(sum(d for _, d, _ in seen["gc"]), 4)
        if beside and hold:  # the gap the swap itself made: from the pause to the first token
            lo2 = bisect.bisect_left(times, hold["t0"])
            seg = times[max(lo2 - 1, 0):hi + 1]
            out["swap_gap_s"] = max((b2 - a2 for a2, b2 in zip(seg, seg[1:])), default=None)
    if beside and hold:
        def rate(t0: float, t1: float) -> float:
            return sum(t0 < t < t1 for t in times) / max(t1 - t0, 1e-9)

        out["receive_tokens_per_s"] = rate(push["t0"], hold["t0"])
        out["baseline_tokens_per_s"] = rate(*baseline)
        out["receive_rate_ratio"] = round(out["receive_tokens_per_s"]
                                          / max(out["baseline_tokens_per_s"], 1e-9), 3)
        out["swap_window"] = ([pause["t1"], resume["t0"] if resume else pause["t1"]] if pause
                              else [rpc["t0"], rpc["t1"]])
        spanned(out, requests)
    out["phases_s"] = {
        "lead_in": span(edge, "t0", pause, "t0"), "pause": span(pause, "t0", pause, "t1"),
        "to_push": span(pause, "t1", push, "t0"), "push": span(push, "t0", push, "t1"),
        "to_rpc_return": span(push, "t1", rpc, "t1"),
        "reset_prefix_cache": span(reset, "t0", reset, "t1"),
        "resume": span(resume, "t0", resume, "t1"),
        "to_first_token": span(resume or reset or rpc, "t1", edge, "t1")}
    out["phases_s"]["other"] = out["stall_s"] - sum(
        x for x in out["phases_s"].values() if x is not None)
    per = []
    for c in range(clients):
        g = gap_around(sorted(t for t, k in tokens if k == c), push["t0"])
        if g is not None:
            per.append(g[1] - g[0])
    out["client_stall_s"] = {"median": statistics.median(per), "max": max(per)} if per else None
    out["excess_s"] = out["stall_s"] - out["push_s"]
    out["paused_s"] = span(pause, "t0", resume, "t1")
    out["paused_excess_s"] = None if out["paused_s"] is None else out["paused_s"] - out["push_s"]
    if beside:  # the longest time clients saw no token around the update
        out["target_met"] = out["max_gap_s"] is not None and out["max_gap_s"] <= TARGET_S
    else:
        out["target_met"] = (out["paused_excess_s"] is not None
                             and out["paused_excess_s"] <= TARGET_S)
    return out


def spanned(u: dict, requests: list[tuple[float, float, str]]) -> None:
    """Count the requests with tokens on both sides of update `u`'s swap (`wait` promises none);
    call again once every request of the run has ended."""
    t_off, t_on = u["swap_window"]
    u["requests_spanning_swap"] = sum(1 for r in requests if r[0] < t_off and r[1] > t_on)
    u["promise_broken"] = u["mode"] == "beside:wait" and u["requests_spanning_swap"] > 0


def step_interval(tokens: list[tuple[float, int]], windows: list[tuple[float, float]]) -> float:
    """Median gap between a client's consecutive token arrivals, over all clients, leaving out
    the gaps that overlap an update (`windows`): the engine's step as the clients see it."""
    gaps = []
    for c in {k for _, k in tokens}:
        times = sorted({t for t, k in tokens if k == c})
        gaps += [b - a for a, b in zip(times, times[1:])
                 if not any(w0 < b and a < w1 for w0, w1 in windows)]
    return statistics.median(gaps) if gaps else float("nan")


def summarise(updates: list[dict]) -> dict[str, dict]:
    """Per pause mode: median and max of the stall, the push and every phase."""
    out = {}
    for mode in dict.fromkeys(u["mode"] for u in updates):
        ok = [u for u in updates if u["mode"] == mode and "stall_s" in u]
        if not ok:
            continue

        def mm(xs: list[float | None]) -> dict[str, float] | None:  # None: not in every update
            return None if None in xs else {"median": statistics.median(xs), "max": max(xs)}

        out[mode] = {
            "updates": len(ok), "stall_s": mm([u["stall_s"] for u in ok]),
            "push_s": mm([u["push_s"] for u in ok]), "excess_s": mm([u["excess_s"] for u in ok]),
            "paused_s": mm([u["paused_s"] for u in ok]),
            "paused_excess_s": mm([u["paused_excess_s"] for u in ok]),
            "client_stall_max_s": mm([u["client_stall_s"]["max"] for u in ok]),
            "phases_s": {p: mm([u["phases_s"][p] for u in ok]) for p in (*PHASES, "other")},
            "max_gap_s": mm([u["max_gap_s"] for u in ok]),
            "swap_gap_s": mm([u.get("swap_gap_s") for u in ok]),
            "receive_rate_ratio_min": min((u["receive_rate_ratio"] for u in ok
                                           if "receive_rate_ratio" in u), default=None),
            "target_met_all": all(u["target_met"] for u in ok),
        }
    return out


def table(rep: dict) -> str:
    def ms(d: dict | None) -> str:
        return "-" if d is None else f"{d['median'] * 1e3:.1f} ({d['max'] * 1e3:.1f})"

    gb, env = rep["model"]["bytes"] / 1e9, rep["env"]
    lines = [f"`{rep['command']}`", "",
             f"Machine: {env.get('gpu', 'CPU (gloo)')}, torch {env.get('torch')}, CUDA "
             f"{env.get('cuda')}, NCCL {env.get('nccl', '-')}, vLLM {env.get('vllm', '-')}; "
             f"engine {'with' if rep['compiled'] else 'without'} torch.compile + CUDA graphs; "
             f"pushed over {rep['data_plane']}"
             f"{' from the host' if rep['data_plane'] == 'gloo' else ''}.", "",
             f"Model: {gb:.2f} GB bf16, {rep['model']['tensors']} tensors; {rep['clients']} "
             f"streaming clients; step interval {rep['step_interval_s'] * 1e3:.1f} ms; "
             f"median (max) of {rep['updates_per_mode']} updates per mode, ms.", "",
             "Target: paused <= push + 20 ms; beside serving (`beside:`): longest token gap "
             "<= 20 ms. `rate`: decode rate while receiving / undisturbed (min).", "",
             "| mode | paused | push | paused - push | target met | stall | longest gap | swap gap "
             "| rate | stall - push | worst client | " + " | ".join(PHASES) + " | other |",
             "| --- " * (len(PHASES) + 12) + "|"]
    for mode, s in rep["summary"].items():
        lines.append(f"| {mode} | {ms(s['paused_s'])} | {ms(s['push_s'])} "
                     f"| {ms(s['paused_excess_s'])} | {'yes' if s['target_met_all'] else 'NO'} "
                     f"| {ms(s['stall_s'])} | {ms(s['max_gap_s'])} | {ms(s['swap_gap_s'])} "
                     f"| {s['receive_rate_ratio_min'] if s['receive_rate_ratio_min'] is not None else '-'} "
                     f"| {ms(s['excess_s'])} "
                     f"| {ms(s['client_stall_max_s'])} | "
                     + " | ".join(ms(s["phases_s"][p]) for p in (*PHASES, "other")) + " |")
    return "\n".join(lines)
